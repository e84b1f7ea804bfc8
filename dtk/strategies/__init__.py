"""Strategy registry: name -> (builder, one-line description). Adding a strategy is one file and one line here."""
from __future__ import annotations

from typing import Callable

from dtk.strategies.base import BuildContext, Engine


def _ddp(ctx: BuildContext) -> Engine:
    from dtk.strategies.ddp import build
    return build(ctx)


def _fsdp(ctx: BuildContext) -> Engine:
    from dtk.strategies.fsdp import build
    return build(ctx)


def _zero(stage: int) -> Callable[[BuildContext], Engine]:
    def build_stage(ctx: BuildContext) -> Engine:
        from dtk.strategies.zero import build
        return build(ctx, stage=stage)
    return build_stage


def _gcpsl(serial: bool) -> Callable[[BuildContext], Engine]:
    def build_gcpsl(ctx: BuildContext) -> Engine:
        from dtk.strategies.gcpsl import build
        return build(ctx, serial=serial)
    return build_gcpsl


STRATEGIES: dict[str, tuple[Callable[[BuildContext], Engine], str]] = {
    "ddp": (_ddp, "torch DistributedDataParallel: every rank holds everything, gradients all-reduced"),
    "fsdp": (_fsdp, "torch FSDP2 fully_shard per block: parameters, gradients and optimizer sharded"),
    "zero1": (_zero(1), "DeepSpeed ZeRO-1: optimizer states sharded"),
    "zero2": (_zero(2), "DeepSpeed ZeRO-2: optimizer states and gradients sharded"),
    "zero3": (_zero(3), "DeepSpeed ZeRO-3: parameters, gradients and optimizer states sharded"),
    "gcpsl": (_gcpsl(False), "clustered parallel split learning: one cluster of clients per rank, merged every P steps"),
    "gcpsl_serial": (_gcpsl(True), "the same clusters of split-learning clients one after another on one rank (baseline)"),
}


RANK_AGNOSTIC = frozenset({"ddp"})
"""Strategies whose engine does not depend on the rank it is built for (every rank holds everything), so a shadow
can build and warm it before it knows whose place it will take. Sharded engines are built on promotion, after a
rehearsal build for another rank has paid the first build's one-time costs (dtk.worker)."""


REHEARSABLE = frozenset({"fsdp", "zero1", "zero2", "zero3"})
"""Sharded strategies whose shadow rehearses a build (dtk.worker): all of them. (ZeRO-3 was left out until its
module counter, which outlived the rehearsal's engine, was reset at every build: dtk.strategies.zero.)"""


META_INIT = frozenset({"fsdp", "zero3"})
"""Strategies that build the model on meta (ZeRO-3: inside deepspeed.zero.Init) and fill only the shards a rank
holds (BuildContext.blueprint); the others hold the whole model anyway."""


def build_engine(name: str, ctx: BuildContext) -> Engine:
    return STRATEGIES[name][0](ctx)
