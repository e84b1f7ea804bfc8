"""Weights without the whole model: a model is built on the meta device, then each rank fills only the tensors (or
shards) it holds, group by group, with the values a full build gives for the same seed.

Why the values match: a full build and a sharded one run the same procedure. An unsharded "twin" of the meta model
is materialised one group at a time (each wrap unit, i.e. a transformer block, then the modules outside every unit),
on CPU, in fp32; each module of the group is seeded from (seed, its qualified name) and initialised children first
(as `nn.Module.apply` does); then every rank copies the slice it holds into its own tensors and the group goes back
to meta. The values depend on the seed and the names only, never on the order of construction, on the world size
or on the device, so DDP's full model and FSDP's or ZeRO-3's shards hold the same numbers. The peak is one group.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

ModuleInit = Callable[[nn.Module], None]


class WeightSource(Protocol):
    def load_into(self, target: nn.Module) -> list[str]:
        """Write the source's values into the part of each tensor `target` holds; the names it had none for."""


def module_seed(seed: int, name: str) -> int:
    """A seed of its own for each module: the values stay the same when other modules are added or reordered."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def default_init(root: nn.Module) -> ModuleInit:
    """torch's own initialisation (`reset_parameters`), then the model's: `init_module(m)` (dtk's models) or
    `_init_weights(m)` (transformers models, which also rebuild buffers such as rotary frequencies there)."""
    own = getattr(root, "init_module", None) or getattr(root, "_init_weights", None)

    def init(m: nn.Module) -> None:
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()
        if own is not None:
            own(m)
    return init


def _groups(model: nn.Module, units: list[str]) -> Iterator[list[tuple[str, nn.Module]]]:
    """Each unit with all its modules, then every module outside the units; children before parents."""
    inside: set[str] = set()
    for name in units:
        members = [(f"{name}.{n}" if n else name, m) for n, m in model.get_submodule(name).named_modules()]
        inside.update(n for n, _ in members)
        yield members[::-1]
    yield [(n, m) for n, m in list(model.named_modules())[::-1] if n not in inside]


def _direct(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from ((n, t) for n, t in module._parameters.items() if t is not None)
    yield from ((n, t) for n, t in module._buffers.items() if t is not None)


def place(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy into `target` the part of the whole tensor `full` it holds: all of it, a DTensor's local shard (FSDP2),
    or a ZeRO-3 parameter's flat partition (`ds_tensor`)."""
    with torch.no_grad():
        if isinstance(target, DTensor):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, offset = compute_local_shape_and_global_offset(full.shape, target.device_mesh, target.placements)
            local = target.to_local()
            if local.numel():
                index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
                local.copy_(full[index])
        elif hasattr(target, "ds_tensor"):
            part = target.ds_tensor
            start = part.numel() * target.ds_process_group.rank() if hasattr(target, "ds_process_group") else 0
            piece = full.reshape(-1)[start:start + part.numel()]
            part.zero_()  # the last partition's padding
            part.reshape(-1)[:piece.numel()].copy_(piece)
        else:
            target.copy_(full)


def fill(target: nn.Module, twin: nn.Module, *, seed: int, units: list[str], init: ModuleInit) -> None:
    """Give `target` (materialised: whole, sharded or partitioned; same qualified names as `twin`) the values of the
    seed. `twin` is the unsharded model on meta; it is left on meta."""
    for group in _groups(twin, units):
        for _, m in group:
            m.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            for name, m in group:
                # the twin is on CPU: its generator alone. torch.manual_seed would also queue a lazy seeding of
                # every accelerator, each recording the caller's stack (0.2-1 ms a module, on a recovery's path)
                torch.default_generator.manual_seed(module_seed(seed, name))
                init(m)
        for name, m in group[::-1]:  # parents first: a tie ends with the value of its last name, as in a full build
            prefix = f"{name}." if name else ""
            for tname, full in _direct(m):
                place(_get(target, prefix + tname), full.float() if full.is_floating_point() else full)
        for _, m in group:
            m.to_empty(device="meta", recurse=False)


_DRAWS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
          "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")
"""torch.nn.init's functions that give a parameter its values: modules' reset_parameters and models' own inits call
them through the module attribute, so replacing the attribute reaches every caller."""


@contextlib.contextmanager
def undrawn() -> Iterator[None]:
    """Modules built inside get their tensors allocated, not drawn (torch.nn.init does nothing). For a build whose
    values are overwritten before first use; not thread-safe against another thread initialising a model."""
    saved = {name: getattr(nn.init, name) for name in _DRAWS}
    try:
        for name in saved:
            setattr(nn.init, name, _left_as_allocated)
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def _left_as_allocated(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def zero_local(target: nn.Module) -> None:
    """Zeros in every tensor `target` holds: a DTensor's local shard, a ZeRO-3 partition (its padding included)."""
    with torch.no_grad():
        for t in [*target.parameters(), *target.buffers()]:
            if isinstance(t, DTensor):
                t.to_local().zero_()
            elif hasattr(t, "ds_tensor"):
                t.ds_tensor.zero_()
            elif t.device.type != "meta":
                t.zero_()


def _get(model: nn.Module, name: str) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    found = module._parameters.get(leaf)
    if found is not None:
        return found
    buffer = module._buffers[leaf]
    assert buffer is not None  # the names come from _direct, which skips None entries
    return buffer


def ties(model: nn.Module) -> list[list[str]]:
    """Names that share one parameter (a tied embedding and head): `to_empty` gives each its own tensor."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def retie(model: nn.Module, tied: list[list[str]]) -> None:
    for first, *rest in tied:
        owner, _, leaf = first.rpartition(".")
        p = model.get_submodule(owner)._parameters[leaf]
        for name in rest:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, p)


@dataclass(frozen=True, kw_only=True, slots=True)
class Blueprint:
    """How to make one model: build its modules on meta, and give a materialised copy the seed's values."""

    construct: Callable[[], nn.Module]
    """Builds the modules on the current default device (meta, or inside deepspeed.zero.Init); weights drawn
    there are replaced by fill()."""
    seed: int
    units: Callable[[nn.Module], list[str]]
    """The qualified names of the groups materialised one at a time (the wrap units)."""
    dtype: torch.dtype = torch.float32
    weights: WeightSource | None = None
    """Pretrained weights read into the filled model, each rank only its part (dtk.models.pretrained)."""
    blank: bool = False
    """The values are overwritten before first use (an in-place replacement, whose state is rebuilt from parity):
    build() draws nothing and fill() writes zeros, unless the model has buffers, which no rebuild restores. The
    seeded init was most of a promoted ZeRO-3 shadow's build, on the survivors' critical path."""

    def meta(self) -> nn.Module:
        # a draw on meta gives no values: it would only run torch's reference kernels
        with torch.device("meta"), undrawn():
            return self.construct().to(self.dtype)

    def build(self) -> nn.Module:
        """The modules on the current default device (meta, or inside deepspeed.zero.Init); their values are
        fill()'s to give."""
        with undrawn() if self.blank else contextlib.nullcontext():
            return self.construct()

    def fill(self, target: nn.Module, *, twin: nn.Module) -> None:
        if self.blank and next(twin.buffers(), None) is None:
            zero_local(target)
            return
        # the seeded init first: it gives what the files do not hold (non-persistent buffers such as rotary
        # frequencies, a head the file leaves to its tie)
        fill(target, twin, seed=self.seed, units=self.units(twin), init=default_init(twin))
        if self.weights is not None:
            self.weights.load_into(target)

    def full(self, device: torch.device | str = "cpu") -> nn.Module:
        """The whole model on `device`, with the seed's values (what every rank of DDP holds)."""
        model = self.meta()
        twin, tied = copy.deepcopy(model), ties(model)
        model.to_empty(device=device)
        retie(model, tied)
        self.fill(model, twin=twin)
        return model
