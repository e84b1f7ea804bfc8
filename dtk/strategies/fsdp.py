"""FSDP2: `fully_shard` each block, then the root; parameters, gradients and optimizer state are sharded.
`strategy.reshard_after_forward: false` keeps parameters gathered between forward and backward (ZeRO-2 like)."""
from __future__ import annotations

import copy
import logging
from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from dtk.metrics import append_event
from dtk.models import shard_units
from dtk.models.init import retie, ties
from dtk.models.wrap import WrapUnits
from dtk.strategies.base import (BuildContext, build_torch_optimizer, clip_and_step, load_torch_checkpoint_state,
                                 loss_fn, materialize_optimizer_state, optimizer_tensors, prepare_blocks, square_sum,
                                 torch_checkpoint_state)

log = logging.getLogger(__name__)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class FSDPEngine:
    wrap_units: WrapUnits
    """The modules sharded one by one, set while the model is sharded."""

    def __init__(self, ctx: BuildContext):
        r = ctx.recipe
        self.accum, self.clip = r.training.grad_accum, r.optimizer.grad_clip
        mesh = DeviceMesh.from_group(ctx.group, ctx.device.type)
        policy = MixedPrecisionPolicy()
        if r.training.precision == "bf16":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        self.module = _sharded_model(self, ctx, mesh=mesh, policy=policy)
        self.optimizer = build_torch_optimizer(self.module, r.optimizer)

    def forward_backward(self, x, y, *, last_micro: bool) -> torch.Tensor:
        self.module.set_requires_gradient_sync(last_micro)
        loss = loss_fn(self.module(x), y)
        (loss / self.accum).backward()
        return loss.detach()

    def optimizer_step(self) -> None:
        clip_and_step(self.module, self.optimizer, self.clip)

    def discard_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def grad_square_share(self) -> float | None:
        return square_sum(_local(p.grad) for p in self.module.parameters() if p.grad is not None)  # this rank's shards

    def grad_norm(self) -> float | None:
        return None

    def local_state(self) -> list[torch.Tensor]:
        materialize_optimizer_state(self.optimizer)
        params = list(self.module.parameters())
        return [_local(p.data) for p in params] + [_local(t) for t in optimizer_tensors(self.optimizer, params)]

    def match_running_layout(self, x, y) -> None:
        pass  # its collectives do not depend on what the first step saw

    def checkpoint_state(self) -> dict:
        return torch_checkpoint_state(self.module, self.optimizer)

    def after_checkpoint_load(self, state: dict) -> None:
        load_torch_checkpoint_state(self.module, self.optimizer, state)


def _sharded_model(engine: FSDPEngine, ctx: BuildContext, *, mesh: DeviceMesh, policy: MixedPrecisionPolicy):
    """fully_shard each wrap unit, then the root. With a blueprint the model is built on meta and sharded there;
    then each rank allocates only its shards (to_empty) and fills them with the values a full build gives: a rank
    never holds the whole model. Without one (a user target), the whole model is built first, as before."""
    r = ctx.recipe
    twin = None
    if ctx.blueprint is not None:
        model = ctx.blueprint.meta()
        twin, tied = copy.deepcopy(model), ties(model)
    else:
        model = ctx.model_factory().to(ctx.device)
    prepare_blocks(model, r)
    reshard = r.strategy.reshard_after_forward
    engine.wrap_units = units = shard_units(model, names=r.strategy.wrap)
    for unit in units.modules:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    if ctx.group.rank() == 0:
        log.info("fsdp wrap units: %s", units.describe())
        if r.output.dir:  # the run folder; report.py puts the last such event in summary.json
            append_event(r.output.dir, {"event": "fsdp_wrap_units", **units.summary()})
    # fully_shard returns `model` itself, its class now also an FSDPModule; torch types the result FSDPModule alone
    model = cast(nn.Module, fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy))
    if twin is not None:
        model.to_empty(device=ctx.device)
        retie(model, tied)
        assert ctx.blueprint is not None  # twin is made from it
        ctx.blueprint.fill(model, twin=twin)
    return model


def build(ctx: BuildContext) -> FSDPEngine:
    return FSDPEngine(ctx)
