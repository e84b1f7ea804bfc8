"""In-place recovery, the launcher's side: the sequence (notice, replace, reports, plan, rejoin) over a small typed
view of the run's processes, repeated for as many generations as failures keep arriving during it.

Each round: the failed generation is announced (every rank's blocked collectives are released), every lost rank
gets a replacement (a promoted shadow, else a cold process), every other rank reports the step it committed and
whether its state is whole, and the plan names the source (the rank that committed the most steps). A rank that
dies before everyone has rejoined fails the new generation in turn, and the round starts again from there.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch.distributed as dist

from dtk.metrics import append_event
from dtk.resilience import protocol as keys

REPORT_TIMEOUT_S = 300.0


class RecoveryFailed(RuntimeError):
    """In-place recovery cannot finish (no rank holds the state any more, or a report never came)."""


@dataclass(kw_only=True)
class RunState:
    """Where the run stands: its attempt (a set of rank processes), that attempt's store prefix, and the generation
    of its process group. The supervisor alone changes it; the views read it."""

    attempt: int = 0
    control: dist.Store | None = None
    generation: int = 0


class RunView(Protocol):
    """What recovery may do with a run: one node's processes (dtk.resilience.roles.LocalView), or every node's
    (dtk.resilience.nodes.Coordinator, node 0 of several)."""

    @property
    def control(self) -> dist.Store:
        """This attempt's store prefix."""

    @property
    def generation(self) -> int: ...

    @property
    def run_dir(self) -> Path: ...

    def ranks(self) -> list[int]: ...

    def dead(self) -> list[int]:
        """Ranks whose process has exited without finishing."""

    def replace(self, rank: int, generation: int) -> dict:
        """Give `rank` a new process that joins `generation`: a promoted shadow, else a cold start; says which."""


@dataclass(kw_only=True)
class InPlaceFigures:
    """What an in-place recovery measured, for the failure record (dtk.resilience.failures.FailureRecord.in_place).
    Times are the wall clock (time.time()); `*_s` are seconds from the detection."""

    step: int
    """The step the plan resumes the run from (the source's committed steps): the failure's step from now on."""
    resumed_at_step: int
    """The lowest step a rank rejoined at (below `step` when a rank rolled back to its last protection)."""
    steps_lost: int
    rebuilt_from: str
    """Where the lost state came from: parity (its tier) or a peer's replica."""
    rebuild_s: float
    rolled_forward: bool = False
    """The lost rank made its update of the interrupted step again from the survivors' reduced gradients, and the
    survivors kept theirs (resilience.roll_forward): no step redone."""
    source_rank: int
    lost_ranks: list[int]
    """Every rank lost during the recovery, in the order they were replaced (the failed ones first)."""
    survivors: list[int]
    survivor_engines_kept: bool
    """Every survivor rejoined with the engine it had before the failure (nothing rebuilt)."""
    replacements: list[dict]
    """{rank, generation, replacement, ...}: the process each lost rank got (RunView.replace)."""
    rounds: int
    released_at: float
    notice_s: float
    plan_at: float
    plan_s: float
    regrouped_at: float
    repaired_at: float
    repair_bytes: int
    promote_s: float
    regroup_s: float
    recovery_s: float
    """Detection to every rank rejoined."""


@dataclass
class Recovery:
    """One in-place recovery, maybe over several generations; its figures go into the failure record."""

    run: RunView
    t_detect: float
    lost: list[int] = field(default_factory=list)
    replacements: list[dict] = field(default_factory=list)
    rounds: int = 0
    generation: int = 0
    """The generation the run is in once recovered."""

    def run_rounds(self, failed: set[int]) -> InPlaceFigures:
        g, new = self.run.generation, set(failed)
        while True:
            self.rounds += 1
            self.run.control.set(keys.failure(g), f"rank(s) {sorted(new)} failed")
            t_notice = time.time()
            joining = self._replace(new, g + 1)
            reporters = [r for r in self.run.ranks() if r not in joining]
            while True:
                reports = self._wait(g, "failed", reporters, replace_dead=joining, join_generation=g + 1)
                if isinstance(reports, dict):
                    break
                joining |= self._replace(reports, g + 1)  # died before reporting: their state is lost too
                reporters = [r for r in reporters if r not in reports]
            valid = {r: v for r, v in reports.items() if v.get("valid", True)}
            if not valid:
                raise RecoveryFailed("no surviving rank holds the state any more (every holder failed)")
            source = max(valid, key=lambda r: (valid[r]["step"], -r))
            step = valid[source]["step"]
            t_plan = time.time()
            self.run.control.set(keys.plan(g + 1), json.dumps({"source": source, "step": step,
                                                                  "replaced": sorted(joining),
                                                                  "record": valid[source].get("record")}))
            rejoined = self._wait(g + 1, "rejoined", self.run.ranks())
            if isinstance(rejoined, set):  # a rank died during the regroup or the repair: the next round
                append_event(self.run.run_dir, {"event": "recovery round failed", "generation": g + 1,
                                                "ranks": sorted(rejoined)})
                g, new = g + 1, rejoined
                continue
            self.generation = g + 1
            return self._figures(reports=reports, rejoined=rejoined, source=source, step=step, t_notice=t_notice,
                                 t_plan=t_plan)

    def _replace(self, ranks: set[int], generation: int) -> set[int]:
        for r in sorted(ranks):
            self.lost.append(r)
            self.replacements.append({"rank": r, "generation": generation, **self.run.replace(r, generation)})
        return set(ranks)

    def _wait(self, generation: int, kind: str, ranks: list[int], *,
              replace_dead: frozenset[int] | set[int] = frozenset(), join_generation: int = 0):
        """Every rank's report of `kind` for `generation`, or the set of those ranks that died before reporting.
        A replacement in `replace_dead` that dies before the plan is replaced again at once."""
        deadline = time.monotonic() + REPORT_TIMEOUT_S
        wanted = {r: keys.report(generation, kind, r) for r in ranks}
        got: dict[int, dict] = {}
        while len(got) < len(wanted):
            for r, k in wanted.items():
                if r not in got and self.run.control.check([k]):
                    got[r] = json.loads(self.run.control.get(k))
            dead = set(self.run.dead())
            for r in sorted(dead & set(replace_dead)):
                self._replace({r}, join_generation)
            lost = {r for r in dead if r in wanted and r not in got}
            if lost:
                return lost
            done = sorted(r for r in wanted if r not in got and self.run.control.check([keys.done(r)]))
            if done:  # it finished the run and exited: it will never report (a peer failed in the final save)
                raise RecoveryFailed(f"rank(s) {done} finished the run before the failure was recovered; in place "
                                     f"needs them running")
            if time.monotonic() > deadline:
                missing = sorted(set(wanted) - set(got))
                raise RecoveryFailed(f"recovery stalled: no {kind} report from rank(s) {missing} in "
                                     f"{REPORT_TIMEOUT_S:.0f}s")
            time.sleep(0.005)
        return got

    def _figures(self, *, reports, rejoined, source, step, t_notice, t_plan) -> InPlaceFigures:
        released = [v["released_at"] for v in reports.values() if v.get("released_at")]
        replaced = [v for r, v in rejoined.items() if v.get("replacement")]
        engines_kept = all(rejoined[r]["engine_id"] == v["engine_id"] for r, v in reports.items() if r in rejoined)
        back_to = min(v.get("step", step) for v in rejoined.values())
        committed = max(v["step"] for v in reports.values() if v.get("valid", True))
        rebuilt = [v["rebuilt_from"] for v in rejoined.values() if v.get("rebuilt_from")]
        return InPlaceFigures(
            step=step,
            resumed_at_step=back_to,
            steps_lost=max(0, committed - back_to),
            rebuilt_from=rebuilt[0] if rebuilt else f"peer (rank {source})",
            rebuild_s=max((v.get("rebuild_s", 0.0) for v in rejoined.values()), default=0.0),
            rolled_forward=any(v.get("rolled_forward") for v in rejoined.values()),
            source_rank=source,
            lost_ranks=self.lost,
            survivors=sorted(r for r in reports if r not in self.lost),
            survivor_engines_kept=engines_kept,
            replacements=self.replacements,
            rounds=self.rounds,
            released_at=max(released) if released else t_notice,
            notice_s=t_notice - self.t_detect,
            plan_at=t_plan,
            plan_s=t_plan - self.t_detect,
            regrouped_at=max(v["regrouped_at"] for v in rejoined.values()),
            repaired_at=max(v["repaired_at"] for v in rejoined.values()),
            repair_bytes=max((v["repair_bytes"] for v in replaced), default=0),
            promote_s=max((v["ready_at"] for v in replaced), default=self.t_detect) - self.t_detect,
            regroup_s=max(v["regroup_s"] for v in rejoined.values()),
            recovery_s=time.time() - self.t_detect,
        )


def recover_in_place(run: RunView, *, failed: set[int], t_detect: float) -> tuple[int, InPlaceFigures]:
    """Recover the run from the failure of `failed`: (the generation it runs in now, the failure's figures)."""
    recovery = Recovery(run=run, t_detect=t_detect)
    figures = recovery.run_rounds(failed)
    return recovery.generation, figures
