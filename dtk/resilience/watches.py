"""What the supervisor watches between failures: hung ranks (heartbeats that stop advancing) and storms (failures
that come faster than recovery keeps progress); and how an exit status reads."""
from __future__ import annotations

import json
import signal
import statistics
import time
from collections import deque

from dtk.resilience import protocol as keys

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
    """A started rank that has not moved on (a new step or phase) for the timeout is stalled. Of the stalled ranks,
    those with no collective outstanding are the hung ones (the others are waiting for them); if all wait, all are
    hung.

    The timeout is `fixed_s` when the user gives one; otherwise it follows the run: HANG_STEP_MULTIPLE x the p95
    of the step times the ranks report, at least HANG_FLOOR_S, and HANG_ALLOWANCE_S before 3 steps were seen or
    while a rank saves a checkpoint, evaluates or recovers.

    A hang is found within the timeout of the rank's last progress, this watch's poll included: a beat says how long
    its rank has been still by the rank's own clock (`still_s`, no clock shared between hosts is needed), this
    watch adds how long ago it first read that beat, and it declares the hang early by what it may not have seen: one
    beat period (the beat it read may have been written that long ago) and one poll of its own (the next poll may
    come that much after the timeout).

    The first beat read of a rank (at the start, or after `reset` when a rank was replaced) is taken at its word only
    once a newer one shows its writer alive: until then it may be the last beat of the process that was replaced (a
    hung rank killed a moment ago says it has been still for seconds), and it counts only the time since it was read.
    Otherwise a replacement is blamed for its predecessor's hang and killed as it joins."""

    POLL_S = 0.25

    def __init__(self, *, fixed_s: float | None):
        self.fixed_s = fixed_s
        self.step_times: deque[float] = deque(maxlen=200)
        self.reset()

    def reset(self) -> None:
        self.seen: dict[int, tuple[int, float]] = {}
        """Each rank's last step read, and when this watch first read it (for beats without `still_s`)."""
        self.read: dict[int, tuple[float, float, bool]] = {}
        """Each rank's last beat (its time stamp), when this watch first read it, and whether a beat was written
        since this watch first read one of that rank (its writer is alive: its `still_s` holds)."""
        self.phases: dict[int, str] = {}
        """Each rank's phase in its last beat read (train, eval, checkpoint, recovery)."""
        self.hung: dict[int, float] = {}
        self._next_poll = 0.0

    def timeout_s(self, phases: frozenset[str] | set[str] = frozenset()) -> float:
        if self.fixed_s is not None:
            return self.fixed_s
        if len(self.step_times) < 3 or phases & {"checkpoint", "recovery", "eval"}:
            return HANG_ALLOWANCE_S
        p95 = statistics.quantiles(self.step_times, n=20)[-1] if len(self.step_times) > 1 else self.step_times[0]
        return max(HANG_FLOOR_S, HANG_STEP_MULTIPLE * p95)

    def furthest_step(self) -> int:
        """The newest step a rank's beat has shown since the last reset (-1: none)."""
        return max((step for step, _ in self.seen.values()), default=-1)

    def all_past(self, step: int, ranks: list[int]) -> bool:
        """Every rank's last beat read is of a later step than `step`: they have all finished it."""
        return all(self.seen.get(r, (-1, 0.0))[0] > step for r in ranks)

    def recovering(self) -> bool:
        """A rank's last beat said it is recovering: its collectives broke, so a peer is gone."""
        return "recovery" in self.phases.values()

    def describe(self) -> dict:
        return {"heartbeat_timeout_s": self.timeout_s(), "mode": "fixed" if self.fixed_s is not None else "auto",
                "step_times_seen": len(self.step_times)}

    def _still_s(self, rank: int, beat: dict, now: float) -> float:
        """How long `rank` has not moved on, as of now."""
        step, since = self.seen.get(rank, (-1, now))
        if beat["step"] != step:
            self.seen[rank] = (beat["step"], now)
            if beat.get("step_s"):
                self.step_times.append(beat["step_s"])
        if "still_s" not in beat:
            return now - self.seen[rank][1]
        stamp, first_read, alive = self.read.get(rank, (None, now, False))
        if beat["t"] != stamp:
            alive = alive or stamp is not None
            self.read[rank] = (beat["t"], now, alive)
            first_read = now
        if not alive:  # maybe a replaced process's last beat: only the time this watch has seen it unchanged
            return now - first_read
        return beat["still_s"] + (now - first_read)

    def check(self, control, ranks: list[int]) -> list[int]:
        now = time.monotonic()
        if now < self._next_poll:
            return []
        self._next_poll = now + self.POLL_S
        beats, still = {}, {}
        for r in ranks:
            if control.check([keys.beat(r)]):
                beats[r] = json.loads(control.get(keys.beat(r)))
                self.phases[r] = beats[r].get("phase", "train")
                still[r] = self._still_s(r, beats[r], now)
        timeout = self.timeout_s({b.get("phase", "train") for b in beats.values()})
        timeout -= min(self.POLL_S + keys.BEAT_SECONDS, timeout / 4)
        stalled = [r for r in beats if r not in self.hung and still[r] > timeout]
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

    def verdict(self, recoveries_s: list[float]) -> str | None:
        """One line when the run should stop, else None; `recoveries_s`: how long each in-place recovery took."""
        if len(self.streak) < STORM_FAILURES:
            return None
        span = self.streak[-1]["t"] - self.streak[0]["t"]
        every = span / (len(self.streak) - 1)
        took = [s for s in recoveries_s if s]
        recovery = (f"a recovery takes {statistics.median(took):.1f}s" if took
                    else "no restart lasted until its next checkpoint")
        return (f"failures come faster than recovery makes progress: {len(self.streak)} in a row {every:.1f}s "
                f"apart, {recovery}, and the last step that advanced (and was kept) is {self.streak[-1]['committed']}; "
                f"the run is stopped")
