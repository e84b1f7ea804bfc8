"""The launcher's side of in-place recovery: notice to the survivors, a replacement for the failed rank, the plan."""
from __future__ import annotations

import json
import time

from dtk.errors import DtkError

REPORT_TIMEOUT_S = 120.0


class RecoveryFailed(RuntimeError):
    """In-place recovery could not finish (another rank died, or a report never came); the run stops."""


def _wait_keys(launcher, keys: list[str], *, what: str) -> dict[str, dict]:
    """Wait until every key is set, while watching that the processes involved are alive."""
    deadline = time.monotonic() + REPORT_TIMEOUT_S
    got: dict[str, dict] = {}
    while len(got) < len(keys):
        for k in keys:
            if k not in got and launcher.control.check([k]):
                got[k] = json.loads(launcher.control.get(k))
        dead = [r for r, p in launcher.procs.items() if p.poll() not in (None, 0)]
        if dead and len(got) < len(keys):
            raise RecoveryFailed(f"rank(s) {dead} died during recovery ({what})")
        if time.monotonic() > deadline:
            raise RecoveryFailed(f"recovery stalled: no {what} from {sorted(set(keys) - set(got))}")
        time.sleep(0.01)
    return got


def recover_in_place(launcher, *, failed_rank: int, t_detect: float) -> dict:
    g = launcher.generation
    launcher.control.set(f"gen{g}/failure", f"rank {failed_rank} died")
    t_notice = time.time()
    # The replacement starts now: its import and engine build overlap the survivors' wind-down.
    launcher.spawn(failed_rank, join_generation=g + 1)
    survivors = sorted(r for r in launcher.procs if r != failed_rank)
    if not survivors:
        raise DtkError("resilience.mode: 'inplace' needs at least one survivor; world.nproc is 1")
    reports = _wait_keys(launcher, [f"gen{g}/failed/{r}" for r in survivors], what="failure reports")
    by_rank = {int(k.rsplit("/", 1)[1]): v for k, v in reports.items()}
    source = max(by_rank, key=lambda r: (by_rank[r]["step"], -r))
    step = by_rank[source]["step"]
    t_plan = time.time()
    launcher.control.set(f"gen{g + 1}/plan", json.dumps({"source": source, "step": step, "replaced": [failed_rank]}))
    rejoined = _wait_keys(launcher, [f"gen{g + 1}/rejoined/{r}" for r in sorted(launcher.procs)], what="rejoin reports")
    launcher.generation = g + 1
    t_done = time.time()
    released = [v["released_at"] for v in by_rank.values()]
    replacement = rejoined[f"gen{g + 1}/rejoined/{failed_rank}"]
    engines_kept = all(rejoined[f"gen{g + 1}/rejoined/{r}"]["engine_id"] == by_rank[r]["engine_id"] for r in survivors)
    return {
        "step": step,
        "steps_lost": 0,
        "source_rank": source,
        "survivors": survivors,
        "survivor_engines_kept": engines_kept,
        "released_after_detect_s": max(released) - t_detect,
        "released_at": max(released),
        "notice_s": t_notice - t_detect,
        "plan_s": t_plan - t_detect,
        "repair_bytes": replacement["repair_bytes"],
        "regroup_s": max(v["regroup_s"] for v in rejoined.values()),
        "recovery_s": t_done - t_detect,
    }
