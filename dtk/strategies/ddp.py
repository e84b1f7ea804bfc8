"""DDP: every rank holds the whole model and optimizer; gradients are all-reduced in buckets during backward."""
from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel

from dtk.strategies.base import (BuildContext, autocast, build_torch_optimizer, clip_and_step,
                                 load_torch_checkpoint_state, loss_fn, materialize_optimizer_state,
                                 optimizer_tensors, prepare_blocks, square_sum, state_untouched,
                                 torch_checkpoint_state)


class DDPEngine:
    abandons_forward = True
    """A forward ended by an exception leaves DDP as it was (its reducer waits for a backward that never began)."""

    def __init__(self, ctx: BuildContext):
        r = ctx.recipe
        self.device, self.precision, self.rank = ctx.device, r.training.precision, ctx.group.rank()
        self.accum, self.clip = r.training.grad_accum, r.optimizer.grad_clip
        model = prepare_blocks(ctx.model_factory().to(ctx.device), r)
        self.module = DistributedDataParallel(
            model, process_group=ctx.group, bucket_cap_mb=r.strategy.bucket_mb,
            device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        self.optimizer = build_torch_optimizer(model, r.optimizer)

    def forward_backward(self, x, y, *, last_micro: bool) -> torch.Tensor:
        sync = contextlib.nullcontext() if last_micro else self.module.no_sync()
        with sync:
            with autocast(self.device, self.precision):
                logits = self.module(x)
            loss = loss_fn(logits, y)
            (loss / self.accum).backward()
        return loss.detach()

    def optimizer_step(self) -> None:
        clip_and_step(self.module, self.optimizer, self.clip)

    def discard_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def grad_square_share(self) -> float | None:
        # every rank holds the same reduced gradients: rank 0 gives the whole sum, the others nothing
        return square_sum(p.grad for p in self.module.parameters()) if self.rank == 0 else 0.0

    def grad_norm(self) -> float | None:
        return None

    def local_state(self) -> list[torch.Tensor]:
        materialize_optimizer_state(self.optimizer)
        params = list(self.module.parameters())
        return [p.data for p in params] + optimizer_tensors(self.optimizer, params)

    def match_running_layout(self, x, y) -> None:
        # DDP starts with buckets in reverse parameter order and rebuilds them from the order gradients became
        # ready in its first backward. A bucket layout decides where each gradient sits in the all-reduce buffer,
        # hence the order in which ring all-reduce adds the ranks' values: on 3+ ranks another layout gives other
        # sums. So record the order once, rebuild now, and drop the pass.
        if self.module._has_rebuilt_buckets:
            return
        with state_untouched(self.module):
            self.forward_backward(x, y, last_micro=True)
            self.discard_step()
        if self.module.reducer._rebuild_buckets():
            self.module._has_rebuilt_buckets = True

    def checkpoint_state(self) -> dict:
        return torch_checkpoint_state(self.module, self.optimizer)

    def after_checkpoint_load(self, state: dict) -> None:
        load_torch_checkpoint_state(self.module, self.optimizer, state)


def build(ctx: BuildContext) -> DDPEngine:
    return DDPEngine(ctx)
