"""The launcher's side of recovery: naming a failure (and finding hung ranks), the checkpoint-restart baseline,
in-place recovery (notice, replacement, plan), and each failure's figures once the run is over."""
from __future__ import annotations

import json
import signal
import time

from dtk.errors import DtkError

REPORT_TIMEOUT_S = 120.0


def signal_name(code: int) -> str:
    """A process's exit status as a person reads it: "killed by SIGKILL", "exit code 3"."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


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


class HangWatch:
    """A started rank whose step has not advanced for `timeout_s` is stalled. Of the stalled ranks, those with no
    collective outstanding are the hung ones (the others are waiting for them); if all wait, all are hung."""

    def __init__(self, *, timeout_s: float):
        self.timeout_s = timeout_s
        self.reset()

    def reset(self) -> None:
        self.seen: dict[int, tuple[int, float]] = {}
        self.hung: dict[int, float] = {}
        self._next_poll = 0.0

    def check(self, control, ranks: list[int]) -> list[int]:
        now = time.monotonic()
        if now < self._next_poll:
            return []
        self._next_poll = now + 0.25
        beats = {}
        for r in ranks:
            if control.check([f"beat/{r}"]):
                beats[r] = json.loads(control.get(f"beat/{r}"))
                step, since = self.seen.get(r, (-1, now))
                if beats[r]["step"] != step:
                    self.seen[r] = (beats[r]["step"], now)
        stalled = [r for r in beats if r not in self.hung and now - self.seen[r][1] > self.timeout_s]
        if len(stalled) < len(beats):
            return []  # someone still makes progress: a slow step, not a hang
        culprits = [r for r in stalled if beats[r]["outstanding"] == 0] or stalled
        for r in culprits:
            self.hung[r] = time.time()
        return culprits


def describe_failure(launcher, *, rank: int, code: int, t_detect: float) -> dict:
    """What failed, when it was caused (if dtk caused it) and at which step."""
    from dtk.metrics import read_jsonl
    from dtk.resilience.faults import CORRUPT_EXIT

    fired = [f for f in launcher.fired() if f["rank"] == rank and f["id"] not in launcher.attributed]
    fired = [f for f in fired if f["kind"] != "slow"]
    committed = len([r for r in read_jsonl(launcher.run_dir / "metrics.jsonl") if "loss" in r])
    record = {"rank": rank, "exit": signal_name(code), "attempt": launcher.attempt, "generation": launcher.generation,
              "detected_at": t_detect, "step": committed, "fault_time": None}
    if fired:
        f = fired[-1]
        launcher.attributed.add(f["id"])
        record.update(fault=f["kind"], step=f["at_step"], fault_time=f["time"], fault_spec=f["id"])
    elif rank in launcher.hangs.hung:
        record.update(fault="hang")
    else:
        record["fault"] = "corrupt" if code == CORRUPT_EXIT else signal_name(code)
    if code == CORRUPT_EXIT:
        record["detected_by"] = "checksum"
    if rank in launcher.hangs.hung:
        record["detected_by"] = "heartbeat"
        record["hang_detected_at"] = launcher.hangs.hung[rank]
    return record


def restart_from_checkpoint(launcher, *, t_detect: float) -> dict:
    """The baseline: stop every rank, start them all again; they reload the latest checkpoint and redo steps."""
    from dtk.resilience import checkpoint

    launcher.stop_all(grace_s=0.0)  # a failed attempt's ranks have nothing to save: SIGKILL, as a crash would
    t_stopped = time.time()
    found = checkpoint.latest(launcher.run_dir)
    launcher._set_attempt(launcher.attempt + 1)
    launcher.procs = {}
    launcher.spawn_all()
    return {"recovery": "checkpoint restart", "stopped_at": t_stopped, "restart_attempt": launcher.attempt,
            "checkpoint_step": found[0] if found else 0}


def _timelines(launcher, attempt: int) -> list[dict]:
    import torch.distributed as dist

    from dtk.resilience.control import attempt_prefix

    store = dist.PrefixStore(attempt_prefix(attempt), launcher.store)
    out = []
    for r in range(launcher.world):
        if store.check([f"started/{r}"]):
            out.append(json.loads(store.get(f"started/{r}")))
    return out


def finalize_failures(launcher) -> None:
    """Once the run is over, every failure gets its figures: detection, downtime and its breakdown, steps lost.
    Downtime runs from the fault to the completion, after recovery, of the step the fault interrupted."""
    from dtk.metrics import append_event, read_jsonl

    records = [r for r in read_jsonl(launcher.run_dir / "metrics.jsonl") if "loss" in r]
    for f in launcher.failures:
        t_fault = f.get("fault_time") or f["detected_at"]
        f["detect_s"] = f["detected_at"] - t_fault if f.get("fault_time") else None
        back = [r for r in records if r["step"] == f["step"] and r.get("time", 0) > f["detected_at"]]
        f["downtime_s"] = back[0]["time"] - t_fault if back else None
        if f.get("recovery") == "checkpoint restart":
            tl = _timelines(launcher, f["restart_attempt"])
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
            f["breakdown_s"] = {"detect": f["detect_s"] or 0.0, "release": max(0.0, f["released_after_detect_s"]),
                                "plan": f["plan_s"] - max(0.0, f["released_after_detect_s"]),
                                "regroup_and_repair": f["recovery_s"] - f["plan_s"]}
        append_event(launcher.run_dir, {"event": "failure figures", **f})
        with open(launcher.run_dir / "metrics.jsonl", "a") as out:  # rank 0 has stopped writing by now
            out.write(json.dumps({"event": "failure", **f}) + "\n")
