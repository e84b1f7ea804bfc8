"""Model-state bytes per rank, measured from the engine's own tensors: parameters, gradients and optimizer states
(the ZeRO paper's three terms; activations and buffers apart), each storage counted once, padding included."""
from __future__ import annotations

import resource
import weakref
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

# Gradients live only inside a step (the engines drop them after the update), so they are read where the
# optimizer consumes them: a global step pre-hook notes, once per optimizer, the storages of its params' grads
# (DeepSpeed's are views of one flat partition buffer, so its first sub-group's step sees the whole buffer).
_grads: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()
_hook = None
_measured: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def _storage_bytes(tensors, seen: set[int]) -> int:
    """Bytes of the distinct storages under `tensors` not in `seen` (views of one flat buffer count once)."""
    total = 0
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def _note_grads(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if optimizer not in _grads:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            _grads[optimizer] = _storage_bytes(grads, set())


def watch_gradients() -> None:
    """Start noting gradient bytes at optimizer steps; call before the first step (the trainer's module imports
    this one, which calls it)."""
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_note_grads)


def _parts(engine) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.optim.Optimizer]:
    """The model's parameters as this rank holds them, the tensors the optimizer updates, and the torch optimizer
    that steps: DeepSpeed's inner one, which updates DeepSpeed's fp32 master partitions (ZeRO-3 hands it one
    partition at a time, so its param_groups are empty between steps)."""
    if hasattr(engine, "_flat_groups"):  # DeepSpeed ZeRO: flat (ZeRO-3: partitioned) model-dtype groups + masters
        low, master = engine._flat_groups()
        return low, master, engine.optimizer.optimizer
    params = list(engine.module.parameters())
    return params, params, engine.optimizer


def updated_tensors(engine) -> list[torch.Tensor]:
    """The tensors the engine's optimizer updates: DeepSpeed's fp32 master partitions, else the parameters in its
    optimizer's groups (the model's own, or FSDP2's shards)."""
    if hasattr(engine, "_flat_groups"):
        return engine._flat_groups()[1]
    return [p for g in engine.param_groups() for p in g["params"]]


def model_state_bytes(engine) -> dict | None:
    """{"parameters", "gradients", "optimizer_states", "total"} in bytes on this rank, or None before the first
    optimizer step (no gradients or optimizer states exist yet). A master copy of the parameters (DeepSpeed keeps
    one in fp32 whatever the model's dtype) counts as optimizer state, as in the ZeRO paper's K."""
    if engine in _measured:
        return _measured[engine]
    if not hasattr(engine, "_flat_groups") and not hasattr(engine, "optimizer"):
        return None  # an engine with no single optimizer (gcpsl: one per cluster) is not measured here
    params, stepped, optimizer = _parts(engine)
    if optimizer not in _grads or not optimizer.state:
        return None
    seen: set[int] = set()
    parameters = _storage_bytes(params, seen)
    states = _storage_bytes(stepped, seen)  # the master copy; nothing when the optimizer updates the model itself
    states += _storage_bytes((t for state in optimizer.state.values() for t in state.values()), seen)
    out = {"parameters": parameters, "gradients": _grads[optimizer], "optimizer_states": states}
    out["total"] = sum(out.values())
    _measured[engine] = out  # the states keep their sizes from here on (recovery writes into them in place)
    return out


watch_gradients()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _rss_peak_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


@dataclass(kw_only=True)
class BuildMemory:
    """What building the model and the engine cost a rank: RSS growth on CPU (the resident peak is reset when the
    build starts, so a higher peak of the imports before does not hide it), allocated bytes on CUDA."""

    device: torch.device
    start_bytes: int
    peak_reset: bool

    @classmethod
    def start(cls, device: torch.device) -> "BuildMemory":
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            return cls(device=device, start_bytes=torch.cuda.memory_allocated(device), peak_reset=True)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # Linux: reset this process's resident-set high-water mark (VmHWM)
            reset = True
        except OSError:
            reset = False
        return cls(device=device, start_bytes=_rss_bytes(), peak_reset=reset)

    def peak_bytes(self) -> int:
        """Peak growth since start(); without a reset, the current growth (a lower bound)."""
        if self.device.type == "cuda":
            return max(0, torch.cuda.max_memory_allocated(self.device) - self.start_bytes)
        return max(0, (_rss_peak_bytes() if self.peak_reset else _rss_bytes()) - self.start_bytes)
