"""In-place recovery, a rank's side: survivors keep their processes and engines, a replacement (a promoted shadow,
or a cold process) takes the failed rank's number, every rank rebuilds its inner group for the next generation,
and the lost state is repaired from the survivor that committed the most steps (replicated state: DDP).

A peer that fails during the repair fails that generation too: every rank reports again and joins the next one,
so a repair is either complete on a rank or has not touched it.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch
import torch.distributed as dist

from dtk.comm.group import Seam

log = logging.getLogger(__name__)


def repair_from(source: int, tensors: list[torch.Tensor], group: dist.ProcessGroup) -> int:
    """Broadcast `tensors` from `source` into every rank's live tensors, one flat buffer per dtype; returns bytes.
    A rank's tensors are written only once every buffer has arrived whole: a failed repair leaves them as they were."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    flats = []
    with Seam.uncounted():
        for dtype, ts in by_dtype.items():
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            dist.broadcast(flat, dist.get_global_rank(group, source), group=group)
            flats.append((flat, ts))
    if Seam.failure is not None:
        return 0
    nbytes = 0
    with torch.no_grad():
        for flat, ts in flats:
            offset = 0
            for t in ts:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
            nbytes += flat.numel() * flat.element_size()
    return nbytes


def rejoin(*, engine, control, group, generation: int, device: torch.device, committed_step: int, valid: bool,
           on_repair: Callable[[int], None] | None = None, report: dict | None = None, parity=None) -> int:
    """Join `generation` as the launcher's plan says and repair the state; returns the step to run next.
    `valid`: this rank's state is that of `committed_step` (a survivor), not a replacement's blank one.
    `parity` (a ParityKeeper, sharded strategies): every rank rolls back to the newest step protected everywhere and
    the lost ranks' state is decoded from parity; without it the state is broadcast from the plan's source."""
    from dtk.resilience.parity import ParityLost

    while True:
        plan = control.wait_plan(generation)
        control.fence_check()  # fenced before the plan was written: this rank was given to another process
        control.last_plan = plan
        t_plan = time.time()
        if control.generation_failed(generation):  # a peer died before this rank got here: do not wait for it
            control.report(generation, "failed", {"step": committed_step, "valid": valid, "released_at": t_plan,
                                                  "reason": "failed before the rejoin", "engine_id": id(engine)})
            generation += 1
            continue
        if parity is not None:
            parity.settle()  # its exchange was released with the failure; the groups are rebuilt next
        regroup_s = Seam.reconfigure(generation)
        t_regrouped = time.time()
        if on_repair is not None:
            on_repair(plan["step"])  # chaos tests aim faults here: a rank lost while the state is sent
        rebuilt = {}
        if parity is None:
            step_t = torch.tensor([plan["step"]], dtype=torch.int64, device=device)
            nbytes = repair_from(plan["source"], engine.local_state() + [step_t], group)
            step = int(step_t.item())
        else:
            try:
                done = parity.recover(plan["replaced"], committed=committed_step)
            except ParityLost:
                if Seam.failure is None:
                    raise  # not a peer's failure: the parity left cannot rebuild these ranks
                done = None
            if done is not None:
                step, nbytes = done.step, done.bytes_decoded
                rebuilt = {"rebuilt_from": f"parity tier {done.tier}", "rebuild_s": done.seconds,
                           "rolled_forward": done.rolled_forward}
        if Seam.failure is None:
            timings = {"regroup_s": regroup_s, "repair_s": time.time() - t_regrouped, "repair_bytes": nbytes,
                       "plan_seen_at": t_plan, "regrouped_at": t_regrouped, "repaired_at": time.time(),
                       "step": step, "committed": committed_step, **rebuilt}
            control.report(generation, "rejoined", {"engine_id": id(engine), "replacement": not valid, **timings,
                                                    **(report or {})})
            log.warning("joined generation %d at step %d: %s", generation, step, timings)
            return step
        reason = Seam.take_failure()
        log.warning("generation %d failed during the repair (%s); waiting for the next plan", generation, reason)
        control.report(generation, "failed", {"step": committed_step, "valid": valid, "released_at": Seam.failed_at,
                                              "reason": reason, "engine_id": id(engine)})
        generation += 1


def rejoin_as_replacement(*, engine, control, group, generation: int, device: torch.device, ready_at: float,
                          on_repair: Callable[[int], None] | None = None, parity=None) -> int:
    return rejoin(engine=engine, control=control, group=group, generation=generation, device=device,
                  committed_step=-1, valid=False, on_repair=on_repair, report={"ready_at": ready_at}, parity=parity)


def recover_survivor(*, engine, control, group, committed_step: int, device: torch.device,
                     on_repair: Callable[[int], None] | None = None, parity=None, last_record: dict | None = None) -> int:
    """A peer failed in this generation: drop the step, say where this rank stands, join the next generation.
    `last_record` (the committed step's metrics) goes with the report: if rank 0, which writes metrics.jsonl, was
    lost after the others committed a step it never recorded, its replacement writes it from the plan."""
    generation = Seam.generation
    reason = Seam.take_failure()
    engine.discard_step()
    control.report(generation, "failed", {"step": committed_step, "valid": True, "released_at": Seam.failed_at,
                                          "reason": reason, "engine_id": id(engine), "record": last_record})
    log.warning("step %d not committed (%s); waiting for the plan of generation %d", committed_step, reason,
                generation + 1)
    step = rejoin(engine=engine, control=control, group=group, generation=generation + 1, device=device,
                  committed_step=committed_step, valid=True, on_repair=on_repair, parity=parity)
    log.warning("recovered in place at step %d, same engine object %#x", step, id(engine))
    return step
