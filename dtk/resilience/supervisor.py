"""The launcher's side of failures: naming a failure (and finding hung ranks), the checkpoint-restart baseline,
noticing a storm that recovery cannot keep up with, and each failure's figures once the run is over.
(The in-place sequence is dtk.resilience.recovery; shadows are dtk.resilience.shadow.)"""
from __future__ import annotations

import json
import signal
import statistics
import time
from collections import deque

HANG_FLOOR_S = 5.0
"""The shortest automatic hang timeout: a step may stall this long on a loaded machine without being hung."""
HANG_STEP_MULTIPLE = 10.0
"""The automatic hang timeout is this many times the p95 step time..."""
HANG_ALLOWANCE_S = 60.0
"""...except before a few steps were seen, and while a rank saves a checkpoint or recovers."""
STORM_FAILURES = 5
"""Failures in a row with no step committed between them: recovery cannot keep up, the run stops."""


def signal_name(code: int) -> str:
    """A process's exit status as a person reads it: "killed by SIGKILL", "exit code 3"."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class HangWatch:
    """A started rank whose step has not advanced for the timeout is stalled. Of the stalled ranks, those with no
    collective outstanding are the hung ones (the others are waiting for them); if all wait, all are hung.

    The timeout is `fixed_s` when the user gives one; otherwise it follows the run: HANG_STEP_MULTIPLE x the p95
    of the step times the ranks report, at least HANG_FLOOR_S, and HANG_ALLOWANCE_S before 3 steps were seen or
    while a rank saves a checkpoint or recovers."""

    def __init__(self, *, fixed_s: float | None):
        self.fixed_s = fixed_s
        self.step_times: deque[float] = deque(maxlen=200)
        self.reset()

    def reset(self) -> None:
        self.seen: dict[int, tuple[int, float]] = {}
        self.phases: dict[int, str] = {}
        """Each rank's phase in its last beat read (train, eval, checkpoint, recovery)."""
        self.hung: dict[int, float] = {}
        self._next_poll = 0.0

    def timeout_s(self, phases: set[str] = frozenset()) -> float:
        if self.fixed_s is not None:
            return self.fixed_s
        if len(self.step_times) < 3 or phases & {"checkpoint", "recovery", "eval"}:
            return HANG_ALLOWANCE_S
        p95 = statistics.quantiles(self.step_times, n=20)[-1] if len(self.step_times) > 1 else self.step_times[0]
        return max(HANG_FLOOR_S, HANG_STEP_MULTIPLE * p95)

    def recovering(self) -> bool:
        """A rank's last beat said it is recovering: its collectives broke, so a peer is gone."""
        return "recovery" in self.phases.values()

    def describe(self) -> dict:
        return {"heartbeat_timeout_s": self.timeout_s(), "mode": "fixed" if self.fixed_s is not None else "auto",
                "step_times_seen": len(self.step_times)}

    def check(self, control, ranks: list[int]) -> list[int]:
        now = time.monotonic()
        if now < self._next_poll:
            return []
        self._next_poll = now + 0.25
        beats = {}
        for r in ranks:
            if control.check([f"beat/{r}"]):
                beats[r] = json.loads(control.get(f"beat/{r}"))
                self.phases[r] = beats[r].get("phase", "train")
                step, since = self.seen.get(r, (-1, now))
                if beats[r]["step"] != step:
                    self.seen[r] = (beats[r]["step"], now)
                    if beats[r].get("step_s"):
                        self.step_times.append(beats[r]["step_s"])
        timeout = self.timeout_s({b.get("phase", "train") for b in beats.values()})
        stalled = [r for r in beats if r not in self.hung and now - self.seen[r][1] > timeout]
        if len(stalled) < len(beats):
            return []  # someone still makes progress: a slow step, not a hang
        culprits = [r for r in stalled if beats[r]["outstanding"] == 0] or stalled
        for r in culprits:
            self.hung[r] = time.time()
        return culprits


class StormWatch:
    """Failures that come faster than recovery makes progress: STORM_FAILURES in a row with no progress kept between
    them (a step committed in place; a newer checkpoint for the checkpoint baseline, whose restarts lose the rest)."""

    def __init__(self):
        self.streak: list[dict] = []

    def failed(self, *, committed: int, t_detect: float) -> None:
        if self.streak and committed > self.streak[-1]["committed"]:
            self.streak = []
        self.streak.append({"committed": committed, "t": t_detect})

    def verdict(self, failures: list[dict]) -> str | None:
        """One line when the run should stop, else None."""
        if len(self.streak) < STORM_FAILURES:
            return None
        span = self.streak[-1]["t"] - self.streak[0]["t"]
        every = span / (len(self.streak) - 1)
        took = [f["recovery_s"] for f in failures if f.get("recovery_s")]
        recovery = (f"a recovery takes {statistics.median(took):.1f}s" if took
                    else "no restart lasted until its next checkpoint")
        return (f"failures come faster than recovery makes progress: {len(self.streak)} in a row {every:.1f}s "
                f"apart, {recovery}, and the last step that advanced (and was kept) is {self.streak[-1]['committed']}; "
                f"the run is stopped")


def describe_failure(launcher, *, rank: int, code: int | None, t_detect: float) -> dict:
    """What failed, when it was caused (if dtk caused it) and at which step. `code` None: nobody saw the rank exit
    (it was lost with its node)."""
    from dtk.metrics import read_jsonl
    from dtk.resilience.faults import CORRUPT_EXIT

    fired = [f for f in launcher.fired() if f["rank"] == rank and f["id"] not in launcher.attributed]
    fired = [f for f in fired if f["kind"] != "slow"]
    committed = len([r for r in read_jsonl(launcher.run_dir / "metrics.jsonl") if "loss" in r])
    lost_node = launcher.lost_node_of(rank)
    hung_at = launcher.hang_detected_at(rank) if lost_node is None else None  # a lost node's ranks stall too
    exit_ = f"lost with node {lost_node}" if code is None else signal_name(code)
    record = {"rank": rank, "exit": exit_, "attempt": launcher.attempt, "generation": launcher.generation,
              "detected_at": t_detect, "step": committed, "committed": committed, "fault_time": None}
    if fired:
        f = fired[-1]
        launcher.attributed.add(f["id"])
        record.update(fault=f["kind"], step=f["at_step"], fault_time=f["time"], fault_spec=f["id"])
    elif hung_at is not None:
        record.update(fault="hang")
    elif lost_node is not None:
        record["fault"] = "host lost"
    else:
        record["fault"] = "corrupt" if code == CORRUPT_EXIT else signal_name(code)
    if lost_node is not None:
        record.update(detected_by="node heartbeat", node_lost=lost_node,
                      node_silent_s=launcher.node_watch.lost[lost_node])
    if code == CORRUPT_EXIT:
        record["detected_by"] = "checksum"
    if hung_at is not None:
        record["detected_by"] = "heartbeat"
        record["hang_detected_at"] = hung_at
    return record


def restart_from_checkpoint(launcher, *, t_detect: float) -> dict:
    """The baseline: stop every rank, start them all again; they reload the latest checkpoint and redo steps."""
    from dtk.resilience import checkpoint

    launcher.stop_all(grace_s=0.0)  # a failed attempt's ranks have nothing to save: SIGKILL, as a crash would
    t_stopped = time.time()
    found = checkpoint.latest(launcher.run_dir)
    launcher.start_attempt(launcher.attempt + 1)
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
        append_event(launcher.run_dir, {"event": "failure figures", **f})
        with open(launcher.run_dir / "metrics.jsonl", "a") as out:  # rank 0 has stopped writing by now
            out.write(json.dumps({"event": "failure", **f}) + "\n")
