"""In-place recovery (primitives): survivors keep their processes and engines, a new process takes the failed
rank's number, every rank rebuilds its inner group for the next generation, and the state is repaired from the
survivor that committed the most steps (replicated state: DDP)."""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from dtk.comm.group import Seam

log = logging.getLogger(__name__)


def repair_from(source: int, tensors: list[torch.Tensor], group: dist.ProcessGroup) -> int:
    """Broadcast `tensors` from `source` into every rank's live tensors, one flat buffer per dtype; returns bytes."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    nbytes = 0
    with Seam.uncounted():
        for dtype, ts in by_dtype.items():
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            dist.broadcast(flat, dist.get_global_rank(group, source), group=group)
            offset = 0
            with torch.no_grad():
                for t in ts:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
            nbytes += flat.numel() * flat.element_size()
    return nbytes


def rejoin(*, engine, control, group, generation: int, device: torch.device) -> tuple[int, dict]:
    """Wait for the launcher's plan, rebuild the inner groups for `generation`, repair state; returns the step."""
    plan = control.wait_plan(generation)
    t0 = time.perf_counter()
    regroup_s = Seam.reconfigure(generation)
    t1 = time.perf_counter()
    step_t = torch.tensor([plan["step"]], dtype=torch.int64, device=device)
    nbytes = repair_from(plan["source"], engine.local_state() + [step_t], group)
    timings = {"regroup_s": regroup_s, "repair_s": time.perf_counter() - t1, "repair_bytes": nbytes,
               "rejoin_s": time.perf_counter() - t0}
    return int(step_t.item()), timings


def recover_survivor(*, engine, control, group, committed_step: int, device: torch.device) -> int:
    generation = Seam.generation
    reason = Seam.take_failure()
    engine.discard_step()
    control.report(generation, "failed", {"step": committed_step, "released_at": Seam.failed_at,
                                "reason": reason, "engine_id": id(engine)})
    log.warning("step %d not committed (%s); waiting for the plan of generation %d", committed_step, reason, generation + 1)
    step, timings = rejoin(engine=engine, control=control, group=group, generation=generation + 1, device=device)
    log.warning("recovered in place into generation %d at step %d, same engine object %#x: %s",
                generation + 1, step, id(engine), timings)
    control.report(generation + 1, "rejoined", { "engine_id": id(engine), **timings})
    return step
