"""A failure's record: named when the supervisor sees it (what failed, which fault caused it, at which step), then,
once the run is over, given its figures (detection, downtime and its breakdown, steps lost)."""
from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from dtk.metrics import append_event, read_jsonl
from dtk.resilience import protocol as keys
from dtk.resilience.faults import CORRUPT_EXIT
from dtk.resilience.watches import signal_name


def committed_steps(run_dir: Path) -> int:
    """The steps rank 0 has recorded so far (each one committed by every rank)."""
    return len([r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r])


def describe_failure(*, rank: int, code: int | None, t_detect: float, attempt: int, generation: int, committed: int,
                     fired: dict | None, lost_node: int | None, node_silent_s: float | None,
                     hung_at: float | None) -> dict:
    """What failed, when it was caused (if dtk caused it: `fired`, the fault that fired on it) and at which step.
    `code` None: nobody saw the rank exit (it was lost with its node `lost_node`)."""
    exit_ = f"lost with node {lost_node}" if code is None else signal_name(code)
    cause = signal_name(code) if code is not None else "host lost"
    record = {"rank": rank, "exit": exit_, "attempt": attempt, "generation": generation,
              "detected_at": t_detect, "step": committed, "committed": committed, "fault_time": None}
    if fired is not None:
        record.update(fault=fired["kind"], step=fired["at_step"], fault_time=fired["time"], fault_spec=fired["id"])
    elif hung_at is not None:
        record.update(fault="hang")
    elif lost_node is not None:
        record["fault"] = "host lost"
    else:
        record["fault"] = "corrupt" if code == CORRUPT_EXIT else cause
    if lost_node is not None:
        record.update(detected_by="node heartbeat", node_lost=lost_node, node_silent_s=node_silent_s)
    if code == CORRUPT_EXIT:
        record["detected_by"] = "checksum"
    if hung_at is not None:
        record["detected_by"] = "heartbeat"
        record["hang_detected_at"] = hung_at
    return record


def lost_during_recovery(rank: int, *, like: dict, attempt: int, generation: int, t_detect: float) -> dict:
    """A rank that died while the others recovered from `like`'s failure."""
    return {"rank": rank, "fault": "failed during recovery", "exit": "-", "attempt": attempt,
            "generation": generation, "detected_at": t_detect, "step": like["step"], "committed": like["committed"],
            "fault_time": None}


def _timelines(store: dist.Store, *, attempt: int, world: int) -> list[dict]:
    control = keys.attempt_store(store, attempt)
    return [t for r in range(world) if (t := keys.read_json(control, keys.started(r))) is not None]


def finalize_failures(failures: list[dict], *, run_dir: Path, store: dist.Store, world: int) -> None:
    """Once the run is over, every failure gets its figures: detection, downtime and its breakdown, steps lost.
    Downtime runs from the fault to the completion, after recovery, of the step the fault interrupted."""
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    for f in failures:
        t_fault = f.get("fault_time") or f["detected_at"]
        f["detect_s"] = f["detected_at"] - t_fault if f.get("fault_time") else None
        back = [r for r in records if r["step"] == f["step"] and r.get("time", 0) > f["detected_at"]]
        f["downtime_s"] = back[0]["time"] - t_fault if back else None
        if f.get("recovery") == "checkpoint restart":
            tl = _timelines(store, attempt=f["restart_attempt"], world=world)
            start_step = tl[0]["start_step"] if tl else f["checkpoint_step"]
            f["steps_lost"] = f["step"] - start_step
            if tl:
                last = lambda key: max(t[key] for t in tl)  # noqa: E731 - the slowest rank sets each stage's end
                ready = last("loaded_at")
                replayed = [r for r in records if start_step <= r["step"] < f["step"] and r.get("time", 0) > ready]
                f["breakdown_s"] = {
                    "detect": f["detect_s"] or 0.0,
                    "stop": f["stopped_at"] - f["detected_at"],
                    "process_start": last("main_at") - f["stopped_at"],
                    "import": last("imported_at") - last("main_at"),
                    "group_init": last("group_at") - last("imported_at"),
                    "engine_build": last("engine_at") - last("group_at"),
                    "checkpoint_load": ready - last("engine_at"),
                    "replay": (max(r["time"] for r in replayed) - ready) if replayed else 0.0,
                }
        elif "recovery_s" in f:
            t0 = f["detected_at"]
            released = min(max(f["released_at"], t0), f["plan_at"])
            f["breakdown_s"] = {
                "detect": f["detect_s"] or 0.0,
                "release": released - t0,
                "plan": f["plan_at"] - released,
                "regroup": f["regrouped_at"] - f["plan_at"],
                "state_transfer": f["repaired_at"] - f["regrouped_at"],
                "redo": back[0]["time"] - f["repaired_at"] if back else 0.0,
            }
        append_event(run_dir, {"event": "failure figures", **f})
        with open(run_dir / "metrics.jsonl", "a") as out:  # rank 0 has stopped writing by now
            out.write(json.dumps({"event": "failure", **f}) + "\n")
