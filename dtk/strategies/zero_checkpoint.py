"""ZeRO-1/2/3 state for torch.distributed.checkpoint in a layout that does not depend on the rank count.

DeepSpeed keeps each rank's part of the model as flat partitions whose cut points move with the world size. Here
every parameter is saved under its own name as a 1-D tensor of its numel (`zero.model.<name>`: the working copy,
`zero.master.<name>`: the fp32 master, `zero.<state>.<name>`: each optimizer state such as exp_avg; buffers whole
as `zero.buffer.<name>`), and each
rank contributes the slice its partitions hold, as a ShardedTensor whose shards are views into DeepSpeed's live
flat buffers. DCP then reads any slice on any rank count, and a load writes straight into the engine. The three
stages share the layout, so a checkpoint of one stage loads into another.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

PREFIX = "zero."


@dataclass(frozen=True, slots=True)
class Piece:
    """One parameter's slice on one rank: elements [start, start + length) of the flattened parameter."""

    name: str
    numel: int
    start: int
    length: int
    flat: int
    """The index of the flat group (DeepSpeed's param group / sub group) that holds it."""
    at: int
    """Where the slice starts in that group's fp32 partition (and in the optimizer states of it)."""


def _names(module) -> dict[int, str]:
    out: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=True):
        out.setdefault(id(p), name)
    return out


def _layout_stage12(opt, names: dict[int, str], rank: int, world: int) -> tuple[list[Piece], list[list]]:
    """Stages 1/2: each group is one flat (padded at its end) cut into equal partitions, rank r holding the r-th.
    Returns this rank's pieces and, per piece, the (start, length) every rank holds (the shards' metadata)."""
    pieces, everyone = [], []
    for g, params in enumerate(opt.round_robin_bit16_groups):
        size = opt.partition_size[g]
        offset = 0
        for p in params:
            n = p.numel()
            held = []
            for r in range(world):
                lo, hi = max(offset, r * size), min(offset + n, (r + 1) * size)
                held.append((lo - offset, hi - lo) if hi > lo else None)
            everyone.append(held)
            if span := held[rank]:
                start, length = span
                pieces.append(Piece(name=names[id(p)], numel=n, start=start, length=length, flat=g,
                                    at=offset + start - rank * size))
            else:
                pieces.append(Piece(name=names[id(p)], numel=n, start=0, length=0, flat=g, at=0))
            offset += n
    return pieces, everyone


def _layout_stage3(opt, names: dict[int, str], rank: int, world: int) -> tuple[list[Piece], list[list]]:
    """Stage 3: every parameter is cut into `world` equal partitions (the last padded); a group's flat is the
    concatenation of this rank's partitions of its parameters."""
    pieces, everyone = [], []
    for g, params in enumerate(opt.fp16_groups):
        at = 0
        for p in params:
            n, size = p.ds_numel, p.ds_tensor.numel()
            held = [(r * size, min(size, n - r * size)) if n > r * size else None for r in range(world)]
            everyone.append(held)
            start, length = held[rank] or (0, 0)
            pieces.append(Piece(name=names[id(p)], numel=n, start=start, length=length, flat=g, at=at))
            at += size
    return pieces, everyone


def _sharded(local: torch.Tensor | None, piece: Piece, held: list, *, rank: int, dtype: torch.dtype) -> ShardedTensor:
    """A 1-D tensor of the parameter's numel, of which this rank holds `local` (None: nothing)."""
    # A rank that holds nothing of a small parameter still gets an empty shard: with none, ShardedTensor guesses its
    # device from the group's backend name, which is the seam's, not gloo's. It sits at the end: DCP tells a
    # tensor's chunks apart by their offsets, and one at 0 would hide the real chunk that starts there
    spans = [h or (piece.numel, 0) for h in held]
    metas = [ShardMetadata(shard_offsets=[start], shard_sizes=[length], placement=f"rank:{r}/cpu")
             for r, (start, length) in enumerate(spans)]
    if local is None:
        local = torch.empty(0, dtype=dtype)
    meta = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size([piece.numel]),
                                 tensor_properties=TensorProperties(dtype=dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata([Shard(tensor=local, metadata=metas[rank])], meta)


def _flats(zero) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(working-copy flats, fp32 master flats) per group, as DeepSpeed holds them on this rank."""
    opt = zero.optimizer
    if zero.stage == 3:
        return list(opt.fp16_partitioned_groups_flat), list(opt.fp32_partitioned_groups_flat)
    return list(opt.bit16_groups_flat), list(opt.single_partition_of_fp32_groups)


def state(zero) -> dict:
    """The engine's state for DCP; its tensors are the live ones (a load writes into the engine)."""
    zero.local_state()  # creates the optimizer's lazily made state, so there is a tensor to save or load into
    opt, rank = zero.optimizer, zero.rank
    world = zero.world
    names = _names(zero.module)
    if zero.stage == 3:
        pieces, everyone = _layout_stage3(opt, names, rank, world)
    else:
        pieces, everyone = _layout_stage12(opt, names, rank, world)
    master = _flats(zero)[1]
    states = opt.optimizer.state
    kinds = sorted(k for k, v in states[master[0]].items() if isinstance(v, torch.Tensor) and v.dim() == 1)
    out: dict = {}
    params = {name: p for name, p in zero.module.named_parameters()}
    for piece, held in zip(pieces, everyone):
        def view(t: torch.Tensor) -> torch.Tensor | None:
            # detached views share the live storage: a load still writes into the engine
            return t.detach().narrow(0, piece.at, piece.length) if piece.length else None

        if zero.stage == 3:
            ds = params[piece.name].ds_tensor.detach()
            out[f"{PREFIX}model.{piece.name}"] = _sharded(ds.narrow(0, 0, piece.length) if piece.length else None,
                                                          piece, held, rank=rank, dtype=ds.dtype)
        else:  # stages 1/2: every rank holds the whole working copy
            out[f"{PREFIX}model.{piece.name}"] = params[piece.name].detach().view(-1)
        fp32 = master[piece.flat]
        out[f"{PREFIX}master.{piece.name}"] = _sharded(view(fp32), piece, held, rank=rank, dtype=fp32.dtype)
        for kind in kinds:
            t = states[fp32][kind]
            out[f"{PREFIX}{kind}.{piece.name}"] = _sharded(view(t), piece, held, rank=rank, dtype=t.dtype)
    for name, b in zero.module.named_buffers():  # replicated (BatchNorm statistics, ...): saved once, loaded by all
        out[f"{PREFIX}buffer.{name}"] = b
    steps = [states[f]["step"] for f in master if "step" in states.get(f, {})]
    if steps:
        out[f"{PREFIX}step"] = steps[0].clone() if isinstance(steps[0], torch.Tensor) else torch.tensor(steps[0])
    return out


def after_load(zero, loaded: dict) -> None:
    """DCP wrote into the live slices; what is left: the optimizer's step counter of every group."""
    step = loaded.get(f"{PREFIX}step")
    if step is None:
        return
    states = zero.optimizer.optimizer.state
    for f in _flats(zero)[1]:
        if "step" in states.get(f, {}):
            if isinstance(states[f]["step"], torch.Tensor):
                states[f]["step"].copy_(step)
            else:
                states[f]["step"] = step.item()
