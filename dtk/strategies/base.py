"""The Strategy interface: what every engine (DDP, FSDP, ZeRO) gives the trainer and the resilience layer."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dtk.errors import DtkError
from dtk.models.init import Blueprint
from dtk.models.units import prepare_units
from dtk.recipe import Recipe
from dtk.strategies.param_groups import param_groups


@dataclass(frozen=True, kw_only=True, slots=True)
class BuildContext:
    """What a strategy needs to build its engine; the group is always the seam (a DtkGroup)."""

    model_factory: Callable[[], nn.Module]
    recipe: Recipe
    group: dist.ProcessGroup
    device: torch.device
    blueprint: Blueprint | None = None
    """Set for the strategies that build the model on meta and fill only their shards (META_INIT); they then
    ignore model_factory."""


def prepare_blocks(model: nn.Module, recipe) -> nn.Module:
    """Activation checkpointing and torch.compile of the wrap units, as the recipe asks, before any wrapping."""
    t = recipe.training
    prepare_units(model, names=recipe.strategy.wrap, checkpointing=t.activation_checkpointing, compile=t.compile)
    return model


class Engine(Protocol):
    @property
    def module(self) -> nn.Module:
        """The model as the strategy wraps it (DDP, FSDP2's sharded module, DeepSpeed's engine)."""

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, *, last_micro: bool) -> torch.Tensor:
        """One micro-step: forward, loss, backward (gradients reduced on the last micro-step); returns the loss."""

    def optimizer_step(self) -> None:
        """Commit the step: clip (if asked), update, zero gradients."""

    def discard_step(self) -> None:
        """Drop this step's gradients without updating (its collectives failed)."""

    def param_groups(self) -> list[dict]:
        """The optimizer's parameter groups; the trainer sets each one's "lr" before every update (dtk.schedule)."""

    def grad_square_share(self) -> float | None:
        """After the last micro-step, before the update: this rank's part of the squared global gradient norm (the
        trainer sums the ranks' parts in its gather of small numbers, so no collective is added to the update); None
        when the engine measures the norm inside its own update (grad_norm)."""

    def grad_norm(self) -> float | None:
        """After the update: the global gradient norm (before clipping) the update measured; None when
        grad_square_share gave it."""

    def local_state(self) -> list[torch.Tensor]:
        """The ordered tensors that make this rank this rank: parameters (or shards), optimizer state, counters.
        They are the live tensors: writing into them changes the engine."""

    # Optional: note_grad_square_total(total), the sum of the ranks' grad_square_share, before the update that uses
    # it as its norm (ZeRO-3 with roll forward, whose update then needs no collective).
    # Optional: protected_state() -> list[Tensor], the part of local_state() that no peer can make again (what
    # parity protects; default: all of it), and rebuild_replicated(), collective, which makes the rest again from it.

    def checkpoint_state(self) -> dict:
        """A state dict for torch.distributed.checkpoint (save and load in place)."""

    def after_checkpoint_load(self, state: dict) -> None:
        """Push a loaded checkpoint_state() back into the engine."""

    def match_running_layout(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Give a freshly built engine the communication layout a running one has after its first step, without
        changing its state, so that it reduces exactly as the engine it replaces (same buckets, same order).
        Every rank calls it together on a restart; a joining rank calls it on its local group."""


class RollsForward(Engine, Protocol):
    """An engine whose update one rank can make alone from its reduced gradients (resilience.roll_forward: FSDP2,
    ZeRO-3)."""

    def reduced_keys(self) -> dict[int, int] | list[list[tuple[int, int]]] | None:
        """After the last micro-step: the storage address of each reduce-scatter output the gradients view -> the
        engine's key for it (the same on every rank), or, for each reduce-scatter of the step in order, the (key,
        bytes) of the pieces its output holds (dtk.resilience.reduced.ReducedGrads.seal); None when they cannot be
        put back from those outputs."""

    def update_alone(self, chunks: list[tuple[int, torch.Tensor]]) -> None:
        """This rank's update (the optimizer's step at the learning rate set) from (key, that output's bytes) pairs,
        the gradients the backward would have made, with no collective."""


def logits_of(output) -> torch.Tensor:
    """A model's output as logits: a tensor, an object with `.logits` (transformers' ModelOutput) or a dict with
    "logits", or a tuple's first item."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise DtkError(f"model: forward returned a {type(output).__name__}; accepted: a tensor of logits, an object "
                   "with .logits (or a dict with 'logits'), or a tuple whose first item is the logits")


def loss_fn(output, y: torch.Tensor) -> torch.Tensor:
    """Every strategy's loss: cross-entropy of the model's logits (whatever shape its output comes in)."""
    logits = logits_of(output)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def build_torch_optimizer(params, cfg) -> torch.optim.Optimizer:
    """`params`: a model (grouped by dtk.strategies.param_groups: no decay on biases, norms, embeddings) or a list of
    parameters (one group)."""
    if isinstance(params, nn.Module):
        params = param_groups(params, cfg)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    # foreach=False: the same per-parameter math under every strategy (DeepSpeed steps one flat tensor)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, foreach=False)


def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create lazily-made optimizer state (a fresh process has none) so its tensors can receive a peer's, or be
    protected by parity before the first update, without changing the run: the dry step's parameter change
    (weight decay) is undone and its state zeroed, which is the state Adam, AdamW and SGD (dampening 0) create."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(p in optimizer.state and optimizer.state[p] for p in params):
        return
    if any(isinstance(p, DTensor) for p in params) and _materialize_from_local(optimizer):
        return
    if _materialize_adam(optimizer):
        return
    saved = [p.detach().clone() for p in params]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p, before in zip(params, saved):
            p.copy_(before)
            for t in optimizer.state[p].values():
                if isinstance(t, torch.Tensor):
                    t.zero_()


def _materialize_adam(optimizer: torch.optim.Optimizer) -> bool:
    """Adam's and AdamW's state made by their own lazy initialisation (`_init_group`), not by a dry step: the dry
    step allocated, computed and zeroed three state-sized temporaries, 26 ms of a promoted ZeRO-1 shadow's 50 ms
    between its promotion and the regroup, for the 3.2M GPT, while the survivors waited (page faults and the
    update). Each parameter is handed an uninitialised gradient for the call (no memory touched). False (nothing
    made) for another optimizer, or where torch's Adam no longer has that method."""
    init = getattr(optimizer, "_init_group", None)
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or init is None:
        return False
    for group in optimizer.param_groups:
        fresh = [p for p in group["params"] if not optimizer.state.get(p)]
        held = [p.grad for p in fresh]
        for p in fresh:
            p.grad = torch.empty_like(p)
        try:
            init(group, [], [], [], [], [], [])
        finally:
            for p, grad in zip(fresh, held):
                p.grad = grad
    return True


def _materialize_from_local(optimizer: torch.optim.Optimizer) -> bool:
    """DTensor parameters (FSDP2): the dry step on a twin optimizer over plain copies of the local shards, its state
    then wrapped as DTensors laid out as their parameters. The dry step on the DTensors themselves costs a DTensor
    dispatch per optimizer op (0.1 s for the 3.2M GPT, on a promoted shadow's critical path); this costs a step on
    plain tensors. False (nothing changed) when a state tensor is not shaped like its parameter's shard or a scalar:
    the twin's state could not be laid out as a DTensor's."""
    groups, twins = [], {}
    for g in optimizer.param_groups:
        local = []
        for p in g["params"]:
            shard = p.to_local() if isinstance(p, DTensor) else p
            twins[p] = torch.zeros_like(shard.detach(), requires_grad=True)
            local.append(twins[p])
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": local})
    make: Callable[..., torch.optim.Optimizer] = type(optimizer)
    try:
        twin = make(groups)  # torch's optimizers take their param groups alone: the groups carry the settings
    except TypeError:  # an optimizer that needs more to be built: the dry step on the DTensors instead
        return False
    if not _materialize_adam(twin):
        for t in twins.values():
            t.grad = torch.zeros_like(t)
        twin.step()
    made: dict = {}
    for p, t in twins.items():
        state = {}
        for key, value in twin.state[t].items():
            if isinstance(value, torch.Tensor):
                value = torch.zeros_like(value)
                if isinstance(p, DTensor) and value.dim():
                    if value.shape != t.shape:
                        return False
                    value = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                               stride=p.stride())
            state[key] = value
        made[p] = state
    for p, state in made.items():
        optimizer.state[p] = state
    return True


def optimizer_tensors(optimizer: torch.optim.Optimizer, params) -> list[torch.Tensor]:
    out = []
    for p in params:
        for _, t in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


def square_sum(tensors) -> float:
    """The sum of the squared entries of `tensors` (None entries skipped), in float64."""
    # vector_norm accumulates in float64 without a float64 copy of the tensor: 8x faster than .double().pow(2).sum()
    # on CPU (5 ms a step on a 3.2M model's grads, paid every step on the rank that reports the norm)
    norms = [torch.linalg.vector_norm(t.detach(), dtype=torch.float64) for t in tensors if t is not None]
    return float(torch.stack(norms).square().sum()) if norms else 0.0


def clip_and_step(module: nn.Module, optimizer: torch.optim.Optimizer, clip: float) -> None:
    """The commit of a torch-optimizer engine (DDP, FSDP2): clip the global norm if asked, update, drop grads."""
    if clip:
        torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def torch_checkpoint_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """DCP-ready model + optimizer state (reshardable: DTensors for FSDP2, plain tensors for DDP)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(module, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def load_torch_checkpoint_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


@contextlib.contextmanager
def state_untouched(module: nn.Module):
    """Run a throw-away pass: buffers (e.g. BatchNorm statistics) and the RNG come back as they were."""
    buffers = [b.detach().clone() for b in module.buffers()]
    rng = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(rng)
        with torch.no_grad():
            for b, saved in zip(module.buffers(), buffers):
                b.copy_(saved)


def autocast(device: torch.device, precision: str):
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
