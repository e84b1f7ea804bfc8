"""Held-out evaluation at step boundaries (eval.every): every rank runs eval.batches validation batches through the
engine's module without gradients, the sums are gathered, and rank 0 records eval_loss (and eval_perplexity for
tokens, eval_accuracy for classes) in metrics.jsonl.

An evaluation whose collectives failed is not recorded; the trainer recovers and runs it again on the repaired state
(the state of the same step boundary, so the figures are the same). Every rank — a replacement or a restarted one
too — evaluates at a due boundary it has not evaluated since it started or recovered; rank 0 writes a boundary's
record once, so a redone evaluation never adds a second line.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from dtk.comm.group import Seam
from dtk.data.spec import Dataset, has_validation
from dtk.metrics import MetricsWriter, read_jsonl
from dtk.strategies.base import autocast, logits_of, loss_fn


@dataclass(kw_only=True)
class Evaluator:
    every: int
    batches: int
    steps: int
    """training.steps: the last boundary is evaluated too."""
    dataset: Dataset
    module: torch.nn.Module
    device: torch.device
    precision: str
    micro_batch: int
    rank: int
    world: int
    gather: Callable[[list[float]], torch.Tensor]
    """All ranks' values as a (world, len) tensor: the trainer's uncounted exchange."""
    writer: MetricsWriter | None
    after_first_batch: Callable[[int], None] = lambda step: None
    """Called with the boundary after the first batch (where a fault aimed at phase eval fires)."""
    done_at: int | None = field(default=None, init=False)

    def due(self, step: int) -> bool:
        """`step` optimizer updates are done; evaluate here?"""
        if not self.every or step <= 0 or step == self.done_at:
            return False
        return step % self.every == 0 or step == self.steps

    def forget(self) -> None:
        """After a recovery the boundary's evaluation is run again: every rank must take part in it."""
        self.done_at = None

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        first = next(self.module.parameters(), None)
        if x.is_floating_point() and first is not None and first.dtype == torch.bfloat16:
            x = x.to(torch.bfloat16)  # DeepSpeed's bf16 modules hold bf16 weights and take bf16 inputs
        with autocast(self.device, self.precision):
            return self.module(x)

    def run(self, step: int) -> bool:
        """Evaluate at boundary `step`; False when a peer failed during it (nothing recorded)."""
        t0 = time.perf_counter()
        was_training = self.module.training
        self.module.eval()  # dropout off; every strategy's module runs its forward collectives as in training
        loss_sum = correct = count = 0.0
        images = self.dataset.spec.kind == "images"
        try:
            with torch.no_grad(), Seam.uncounted():  # not a step's traffic
                for b in range(self.batches):
                    assert has_validation(self.dataset)  # eval.every is for a data set with a validation split
                    x, y = self.dataset.val_batch(index=b * self.world + self.rank, size=self.micro_batch)
                    x, y = x.to(self.device), y.to(self.device)
                    out = self._forward(x)
                    loss_sum += float(loss_fn(out, y)) * len(y)
                    count += len(y)
                    if images:
                        correct += float((logits_of(out).argmax(-1) == y).sum())
                    if b == 0:
                        self.after_first_batch(step)
        finally:
            self.module.train(was_training)
        rows = self.gather([loss_sum, count, correct])
        if Seam.failure is not None:
            return False
        self.done_at = step
        if self.writer is not None and not self._recorded(step - 1):
            total = rows.sum(0).tolist()
            loss = total[0] / total[1]
            record = {"step": step - 1, "eval_loss": loss, "eval_samples": int(total[1]),
                      "eval_seconds": time.perf_counter() - t0, "time": time.time()}
            if images:
                record["eval_accuracy"] = total[2] / total[1]
            else:
                record["eval_perplexity"] = math.exp(min(loss, 700.0))
            self.writer.write(record)
        return True

    def _recorded(self, step: int) -> bool:
        assert self.writer is not None  # called only where there is one (rank 0)
        return any(r.get("step") == step and "eval_loss" in r for r in read_jsonl(self.writer.path))

