"""The strategy-agnostic training loop: one step = micro-steps, commit (optimizer step), one record.

A step whose collectives failed (the seam flags it) is not committed: its gradients are dropped, the group is
rebuilt in place with the failed rank's replacement, the state is repaired, and the same step runs again.
"""
from __future__ import annotations

import logging
import math
import os
import resource
import time
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist

from dtk import export, loggers, schedule
from dtk.comm.dispatch import step_boundary as comm_boundary
from dtk.comm.group import Seam
from dtk.data.spec import Dataset
from dtk.evaluation import Evaluator
from dtk.metrics import MetricsWriter
from dtk.recipe import Recipe
from dtk.resilience import checkpoint, inplace
from dtk.resilience import protocol as keys
from dtk.resilience.control import Control
from dtk.resilience.faults import CORRUPT_EXIT, Injector, checksum
from dtk.resilience.parity import ParityKeeper
from dtk.resilience.reduced import ReducedGrads
from dtk.strategies.base import Engine, RollsForward, logits_of
from dtk.strategies.dtypes import DtypeProbe
from dtk.strategies.memory import BuildMemory, model_state_bytes

log = logging.getLogger(__name__)
# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class StepAbandoned(Exception):
    """A peer's failure was flagged during the step's first forward: the step ends there (Trainer._abandon)."""


def step_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step) * 65_537 + rank


def peak_memory_bytes(device: torch.device, base_rss: int) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss)


@dataclass(kw_only=True)
class Trainer:
    recipe: Recipe
    engine: Engine
    dataset: Dataset
    group: dist.ProcessGroup
    control: Control
    device: torch.device
    base_rss: int
    run_dir: str
    injector: Injector
    parity: ParityKeeper | None = None
    """dtk.resilience.parity.ParityKeeper when sharded state is kept recoverable in place; None otherwise."""
    build_memory: BuildMemory | None = None
    """Started before the model was built; its peak is taken before the first step (summary.json ->
    build_peak_memory_bytes)."""

    def __post_init__(self):
        self.rank, self.world = self.group.rank(), self.group.size()
        t = self.recipe.training
        # an engine that draws its own batches (gcpsl) says how many samples one step trains on
        self.samples_per_step = getattr(self.engine, "samples_per_step", t.micro_batch * t.grad_accum * self.world)
        spec = self.dataset.spec
        self.tokens_per_step = self.samples_per_step * spec.seq_len if spec.kind == "tokens" else 0
        self.writer = None
        if self.rank == 0:
            others = loggers.build(self.recipe.output.loggers, run_dir=self.run_dir,
                                   config=self.recipe.model_dump(mode="json"))
            self.writer = MetricsWriter(self.run_dir, loggers=others)
        self._sums: list[int] | None = None
        self.evaluator = Evaluator(every=self.recipe.eval.every, batches=self.recipe.eval.batches, steps=t.steps,
                                   dataset=self.dataset, module=self.engine.module, device=self.device,
                                   precision=t.precision, micro_batch=t.micro_batch, rank=self.rank, world=self.world,
                                   gather=self._gather, writer=self.writer,
                                   after_first_batch=lambda step: self.injector.at(step, "eval"))
        self.first_step, self.build_peak = 0, 0  # run() sets them
        # a fault aimed at the backward phase fires when backward reaches the model's output
        self.engine.module.register_forward_hook(self._arm_backward_fault)
        self._abandon = False
        """Armed while the step's first forward runs (resilience.mode inplace, an engine whose forward holds no
        per-step state; not under training.compile, whose graphs would guard on it): a peer's failure flagged by then
        ends the step at the next module, before its backward."""
        if (self.recipe.resilience.mode == "inplace" and getattr(self.engine, "abandons_forward", False)
                and not self.recipe.training.compile):
            for m in self.engine.module.modules():
                m.register_forward_pre_hook(self._abandon_if_failed)
            self.engine.module.register_forward_hook(self._disarm)
        self.dtypes = DtypeProbe(self.engine)  # what the first forward computed in: summary.json -> dtypes
        self.reduced: ReducedGrads | None = None
        if self.parity is not None and self.recipe.resilience.roll_forward and hasattr(self.engine, "update_alone"):
            self.rolls = cast(RollsForward, self.engine)
            self.reduced = Seam.reduced = self.parity.reduced = ReducedGrads(rank=self.rank, world=self.world)
            self.parity.roll_forward_fn = self._roll_forward

    def _abandon_if_failed(self, module, inputs) -> None:
        if self._abandon and Seam.failure is not None:
            self._abandon = False
            raise StepAbandoned(Seam.failure)

    def _disarm(self, module, inputs, output) -> None:
        self._abandon = False  # the forward is over: its backward (and a checkpointed block's recompute) runs whole

    def _arm_backward_fault(self, module, inputs, output) -> None:
        output = logits_of(output)  # transformers models return a ModelOutput
        if isinstance(output, torch.Tensor) and output.requires_grad and self.injector.pending:
            step = self.injector.step
            output.register_hook(lambda grad: self.injector.at(step, "backward"))

    def _verify_state(self, step: int) -> None:
        """Between two steps nothing may change a rank's state: a changed checksum is corruption (a bit flip)."""
        every = self.recipe.resilience.checksum_every
        if not every or step % every or self._sums is None:
            return
        now = checksum(self.engine.local_state())
        bad = [i for i, (a, b) in enumerate(zip(self._sums, now)) if a != b]
        if bad:
            log.error("local state corrupted before step %d: checksum mismatch in tensor(s) %s; not training on it",
                      step, bad[:8])
            self.control.mark(keys.corrupt(self.rank), {"step": step, "tensors": bad[:8], "time": time.time()})
            logging.shutdown()
            os._exit(CORRUPT_EXIT)

    def _remember_state(self, step: int) -> None:
        every = self.recipe.resilience.checksum_every
        if every and (step + 1) % every == 0:
            self._sums = checksum(self.engine.local_state())

    # -- one step --
    def _micro_steps(self, step: int) -> torch.Tensor:
        t = self.recipe.training
        losses = []
        for micro in range(t.grad_accum):
            x, y = self.dataset.batch(step=step, rank=self.rank, micro=micro, size=t.micro_batch)
            x, y = x.to(self.device), y.to(self.device)
            self._abandon = micro == 0  # no backward has run: nothing of the step is held yet
            losses.append(self.engine.forward_backward(x, y, last_micro=micro == t.grad_accum - 1))
            self._abandon = False
        return torch.stack(losses).float().mean()

    def _gather(self, values: list[float]) -> torch.Tensor:
        """dtk's own per-step exchange of small numbers (not counted as strategy traffic)."""
        mine = torch.tensor(values, dtype=torch.float64, device=self.device)
        out = torch.zeros(self.world * len(values), dtype=torch.float64, device=self.device)
        with Seam.uncounted():
            _all_gather_single(out, mine, group=self.group)
        return out.view(self.world, len(values)).cpu()

    def _set_lr(self, step: int) -> float:
        """The step's learning rate, a function of the step alone: a resumed or recovered run sets the same."""
        lr = schedule.lr_at(step, cfg=self.recipe.optimizer, total_steps=self.recipe.training.steps)
        schedule.set_lr(self.engine.param_groups(), lr)
        return lr

    def train_step(self, step: int) -> dict | None:
        """Run one step; returns its record, or None when a peer failed and the step was not committed."""
        t0 = time.perf_counter()
        # The RNG (dropout) follows the step, not the process's history: a replacement or restarted rank draws
        # what the rank it replaces would have drawn.
        torch.manual_seed(step_seed(self.recipe.training.seed, step, self.rank))
        self.control.beat(step)
        self.injector.at(step, "forward")
        self._verify_state(step)
        if self.reduced is not None:
            self.reduced.begin(step)
        try:
            loss = self._micro_steps(step)
        except StepAbandoned as e:
            # a peer failed while this rank's first forward ran: its backward and update would run on released
            # collectives only to be dropped; the survivor reports at once, and the plan does not wait for them
            log.warning("step %d abandoned in its forward: %s", step, e)
            self.engine.discard_step()
            return None
        if self.reduced is not None:
            self.reduced.seal(step, self.rolls.reduced_keys())
        self.injector.straggle(time.perf_counter() - t0)
        share = self.engine.grad_square_share()  # None: the engine's update measures the norm
        rows = self._gather([loss.item(), float(peak_memory_bytes(self.device, self.base_rss)), float(self.build_peak),
                             0.0 if share is None else share])
        if share is not None and hasattr(self.engine, "note_grad_square_total"):
            self.engine.note_grad_square_total(float(rows[:, 3].sum()))
        if Seam.failure is not None:
            self.engine.discard_step()
            return None
        self.injector.at(step, "optimizer")
        if self.parity is not None and not self.parity.wait_current():
            self.engine.discard_step()  # a peer failed while the last step's parity was built: do not update
            return None
        cut = Seam.cut
        lr = self._set_lr(step)
        self.engine.optimizer_step()
        self.injector.at(step, "commit")
        if Seam.cut != cut:
            return None  # a collective of the update was cut short: this rank's state is torn, the repair replaces it
        # The update is whole here (DDP's and FSDP's need no collective), even if a peer's failure was seen since
        # the loss was gathered: the step counts, and run() recovers before the next one.
        self._remember_state(step)
        comm = Seam.stats.take()
        seconds = time.perf_counter() - t0
        return {
            "step": step,
            "loss": float(rows[:, 0].mean()),
            "lr": lr,
            "grad_norm": math.sqrt(float(rows[:, 3].sum())) if share is not None else self.engine.grad_norm(),
            "step_seconds": seconds,
            "samples_per_second": self.samples_per_step / seconds,
            "tokens_per_second": self.tokens_per_step / seconds,
            "peak_memory_bytes": [int(v) for v in rows[:, 1].tolist()],
            "model_state_bytes": model_state_bytes(self.engine),
            "comm": comm,
            "generation": Seam.generation,
            "time": time.time(),
            **(self.engine.metrics() if hasattr(self.engine, "metrics") else {}),  # e.g. gcpsl's accuracy
            **({"build_peak_memory_bytes": [int(v) for v in rows[:, 2].tolist()], "dtypes": self.dtypes.seen()}
               if step == self.first_step else {}),
        }

    def _roll_forward(self, step: int, chunks: list[tuple[int, torch.Tensor]]) -> None:
        """A rank rebuilt at `step` whose survivors committed it: its update of `step` from its reduced gradients
        (resilience.roll_forward), the same update the lost rank would have made."""
        self._set_lr(step)
        self.rolls.update_alone(chunks)

    def resume_records(self, step: int) -> None:
        """Rank 0, about to run `step`: drop the records of the steps it will redo, and write the plan's record of the
        step before when it has none. A collective does not end at once on every rank when a peer dies in it: the
        others may count a step whose loss gather failed here, or the rank this one replaces was lost before it wrote
        its last step."""
        if not self.writer:
            return
        self.writer.truncate_from(step)
        record = (self.control.last_plan or {}).get("record")
        if record and record["step"] == step - 1 and not self.writer.has(record["step"]):
            self.writer.write(record)

    def _recover(self, step: int) -> int:
        """In place, after a failure: the step training resumes at."""
        self.control.phase = "recovery"
        step = inplace.recover_survivor(engine=self.engine, control=self.control, group=self.group,
                                        committed_step=step, device=self.device,
                                        on_repair=lambda step: self.injector.at(step, "recovery"),
                                        parity=self.parity, last_record=self.last_record)
        self.control.phase = "train"
        self._sums = None  # a rollback changed the state on purpose: the checksum starts again
        self.resume_records(step)  # a rollback to an older protected step redoes the steps after it
        self.evaluator.forget()  # a replacement evaluates the boundary it joins at: so does every survivor
        return step

    def _all_committed(self, step: int) -> bool:
        """Before the boundary work that runs collectives of its own (a checkpoint's save, the end of the run's
        final save), in place: did every peer commit the step? A peer lost in its optimizer step, after the step's
        last collective, is otherwise first seen inside torch.distributed.checkpoint, whose released gather hands it
        garbage. One released all-reduce of one number says it here, and the run recovers instead."""
        r = self.recipe
        due = step >= r.training.steps or bool(r.checkpoint.every and step % r.checkpoint.every == 0)
        if not due or r.resilience.mode != "inplace":
            return True
        with Seam.uncounted():
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)
        return Seam.failure is None

    def _checkpoint(self, step: int) -> bool:
        """Save the checkpoint of `step`; False when, in place, a peer failed during the save. That save is not
        trusted (it has no manifest) and the run recovers. A rollback to an older protected step saves it again on
        the way; otherwise the next boundary's checkpoint is the next one (the replacement joins at this boundary,
        past its save, so it cannot take part in saving it again)."""
        self.control.phase = "checkpoint"
        self.injector.at(step, "checkpoint")
        try:
            checkpoint.save(self.engine, step=step, run_dir=self.run_dir, keep=self.recipe.checkpoint.keep,
                            whole=lambda: Seam.failure is None)
        except Exception:
            if self.recipe.resilience.mode != "inplace" or Seam.failure is None:
                raise
        finally:
            self.control.phase = "train"
        if Seam.failure is None or self.recipe.resilience.mode != "inplace":
            return True  # (outside in place, the launcher stops every rank on a failure)
        log.warning("the checkpoint of step %d is not written: a peer failed during its save", step)
        return False

    def _save_and_stop(self, step: int) -> None:
        """Preempted (SIGTERM to the launcher): every rank is at the same step boundary; save it, so that nothing
        is lost, and leave without finishing (the launcher says where the run stands)."""
        every = self.recipe.checkpoint.every
        if step % every:  # a step that was just saved is not saved twice
            self.control.phase = "checkpoint"
            checkpoint.save(self.engine, step=step, run_dir=self.run_dir, keep=self.recipe.checkpoint.keep)
        if self.parity is not None:
            self.parity.settle()
        log.warning("preempted: stopped after %d steps, saved in %s", step, checkpoint.checkpoint_dir(self.run_dir))
        self.control.mark(keys.preempted(self.rank), {"step": step})

    # -- the loop --
    def run(self, *, start_step: int) -> None:
        r = self.recipe
        step = self.first_step = start_step
        self.build_peak = self.build_memory.peak_bytes() if self.build_memory else 0
        self.last_record: dict | None = None
        Seam.stats.take()  # the engine's start-up traffic (DDP's broadcast, DeepSpeed's init) is not a step's
        if self.parity is not None and self.parity.due(step) and self.parity.rolled_to != step:
            self.parity.protect(step)  # (a rebuilt replacement's rows are protected)
        if self.writer and hasattr(self.dataset, "windows"):  # summary.json -> epochs (tokens)
            self.writer.event({"event": "data", "windows": self.dataset.windows,
                               "samples_per_step": self.samples_per_step})
        while True:
            if self.parity is not None and self.parity.rolled_to == step:
                # rolled forward: every rank is past this boundary's update, and none did its work
                self.parity.rolled_to = -1
                outcome = self._boundary(step, step_seconds=0.0)
                if outcome == "stop":
                    return
                if outcome == "failed":
                    step = self._recover(step)
                    continue
            if self.evaluator.due(step):
                self.control.phase = "eval"
                evaluated = self.evaluator.run(step)
                self.control.phase = "train"
                if not evaluated:  # a peer failed during it: recover, then evaluate this boundary again
                    step = self._recover(step)
                    continue
            if step >= r.training.steps:
                break
            record = self.train_step(step)
            if record is not None:
                step += 1
                self.last_record = record
                self.control.step_seconds = record["step_seconds"]
                if self.writer:
                    self.writer.write(record)
            if record is None or Seam.failure is not None or not self._all_committed(step):
                step = self._recover(step)  # a failure seen after a whole update: no more collectives
                continue
            outcome = self._boundary(step, step_seconds=record["step_seconds"])
            if outcome == "stop":
                return
            if outcome == "failed":
                step = self._recover(step)  # a peer failed during the save
        if self.parity is not None:
            self.parity.settle()
            if self.writer:  # what keeping parity cost this run: summary.json -> parity
                self.writer.event({"event": "parity", **self.parity.figures()})
        self._save_final(step)
        if self.writer:
            self.writer.close()
        self.control.finish(step)

    def _boundary(self, step: int, *, step_seconds: float) -> str:
        """The work between a committed update and the next step, on every rank: protect, the comm plan, the
        checkpoint, a planned regroup, a requested stop. "failed" (a peer failed during the save), "stop" (the
        run was saved and stops here) or "next"."""
        r = self.recipe
        if self.parity is not None and self.parity.due(step):  # resilience.protect_every
            self.parity.protect(step, step_seconds=step_seconds)  # overlaps the next forward/backward
        elif self.parity is not None:
            self.parity.catch_up()  # the last rebuild's stripes, off the recovery's critical path
        for event in comm_boundary(step):  # comm.mode adaptive: the planner may change the plan here
            if self.writer:
                self.writer.event(event)
        if r.checkpoint.every and step % r.checkpoint.every == 0 and not self._checkpoint(step):
            return "failed"
        if step in r.comm.regroup_at:
            if self.parity is not None:
                self.parity.settle()
            seconds = Seam.reconfigure(Seam.generation + 1)
            log.info("planned regroup after step %d: generation %d in %.3fs", step, Seam.generation, seconds)
            if self.writer:
                self.writer.event({"event": "regroup", "step": step, "generation": Seam.generation,
                                   "seconds": seconds})
        if r.checkpoint.every and self.control.stop_at(step) == step and step < r.training.steps:
            self._save_and_stop(step)
            return "stop"
        return "next"

    def _save_final(self, step: int) -> None:
        r = self.recipe
        if not r.output.save_final:
            return
        if r.strategy.name.startswith("gcpsl"):  # one model per cluster of clients: no one final model
            log.info("output.save_final: %s keeps one model per cluster; no final/ written", r.strategy.name)
            return
        self.control.phase = "checkpoint"  # a long save is not a hang
        checkpointed = bool(r.checkpoint.every) and step % r.checkpoint.every == 0  # saved by run(), or resumed from
        export.save_final(self.engine, r=r, run_dir=self.run_dir, step=step, rank=self.rank, checkpointed=checkpointed)
        self.control.phase = "train"
