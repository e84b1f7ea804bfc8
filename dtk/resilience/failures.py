"""A failure's record (FailureRecord): named when the supervisor sees it (what failed, which fault caused it, at which
step), given the figures of its recovery, then, once the run is over, those of its cost (detection, downtime and its
breakdown, steps lost)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Literal

import torch.distributed as dist

from dtk.metrics import append_event, read_jsonl
from dtk.resilience import protocol as keys
from dtk.resilience.faults import CORRUPT_EXIT
from dtk.resilience.nodes import NodeLoss
from dtk.resilience.recovery import InPlaceFigures
from dtk.resilience.watches import signal_name


def committed_steps(run_dir: Path) -> int:
    """The steps rank 0 has recorded so far (each one committed by every rank)."""
    return len([r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r])


RecoveryKind = Literal["in place", "checkpoint restart", "none (stopped)"]


@dataclass(kw_only=True)
class CheckpointRestart:
    """The baseline's part of a record, from the supervisor's restart."""

    stopped_at: float
    """When every rank of the failed attempt was stopped."""
    restart_attempt: int
    """The attempt that restarted the ranks (its store prefix holds their start-up timelines)."""
    checkpoint_step: int
    """The step of the latest checkpoint when the ranks were restarted (0: none, they start over)."""


@dataclass(kw_only=True)
class Figures:
    """What the failure cost, figured once the run is over (finalize_failures)."""

    detect_s: float | None
    """The fault to its detection; None when dtk did not cause the fault (its time is unknown)."""
    downtime_s: float | None
    """The fault to the completion, after recovery, of the step it interrupted; None when it never completed."""
    steps_lost: int | None = None
    """A checkpoint restart's steps redone (in place: InPlaceFigures.steps_lost; stopped: none)."""
    breakdown_s: dict[str, float] | None = None
    """The downtime by stage (dtk.cli.STAGE_ORDER), when the stages' times are known."""


@dataclass(kw_only=True)
class FailureRecord:
    """One failed rank: named by the supervisor when it sees the failure (describe_failure), then given the figures
    of its recovery (`recovered_in_place` or `restarted`; neither when the run stopped) and, once the run is over,
    of its cost (`figures`).

    Its JSON form (`to_dict`, in summary.json, events.jsonl and metrics.jsonl) is flat and holds only what the record
    has: an optional field that is None is left out, and so is each part the failure never had. It reads like that
    form, too (`record["key"]`, `record.get("key")`)."""

    rank: int
    exit: str
    """How the process ended ("killed by SIGKILL", "exit code 3"), "lost with node K", or "-" (died during a
    recovery)."""
    attempt: int
    generation: int
    detected_at: float
    step: int
    """The step the failure interrupted: the fault's step, else the steps committed; once recovered in place, the
    step the plan resumed from."""
    committed: int
    """The steps rank 0 had recorded when the failure was seen."""
    fault_time: float | None
    """When the fault that caused it fired (dtk caused it), else None."""
    fault: str
    """The cause: a fault kind, "hang", "host lost", "corrupt", the exit status, or "failed during recovery"."""
    fault_spec: str | None = None
    """The id of the fault that fired (dtk caused it)."""
    detected_by: str | None = None
    """"connection error" or "node heartbeat" (its node lost), "checksum" or "heartbeat"; None: the process exit."""
    node_lost: int | None = None
    node_silent_s: float | None = None
    node_address: str | None = None
    """The lost node's address a survivor's broken connection named (detected by "connection error")."""
    node_refused: bool | None = None
    """Its launcher's line refused node 0's call (dtk.resilience.nodes.NodeLine): lost with no silence waited for."""
    hang_detected_at: float | None = None
    in_place: InPlaceFigures | None = None
    restart: CheckpointRestart | None = None
    figures: Figures | None = None

    @property
    def recovery(self) -> RecoveryKind:
        if self.in_place is not None:
            return "in place"
        return "checkpoint restart" if self.restart is not None else "none (stopped)"

    @property
    def steps_lost(self) -> int | None:
        if self.in_place is not None:
            return self.in_place.steps_lost
        return self.figures.steps_lost if self.figures is not None else None

    def recovered_in_place(self, figures: InPlaceFigures) -> None:
        self.in_place = figures
        self.step = figures.step

    def restarted(self, restart: CheckpointRestart) -> None:
        self.restart = restart

    def to_dict(self) -> dict:
        """The record as the run folder holds it. The order of the keys is that of the steps that filled it."""
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in _PARTS and (f.name in _ALWAYS or getattr(self, f.name) is not None)}
        if self.in_place is not None:
            out.update(asdict(self.in_place))
        if self.restart is not None:
            out.update(recovery="checkpoint restart", **asdict(self.restart))
        if self.figures is not None:
            out.update({k: v for k, v in asdict(self.figures).items() if v is not None or k in _ALWAYS})
        return out

    @classmethod
    def from_dict(cls, d: dict) -> FailureRecord:
        """A record read back from its JSON form (another node's, or a summary.json). In place, that form says so by
        its figures alone: it has no `recovery` key."""
        own = {f.name: d[f.name] for f in fields(cls) if f.name not in _PARTS and f.name in d}
        record = cls(**own)
        if "recovery_s" in d:
            record.in_place = InPlaceFigures(**{f.name: d[f.name] for f in fields(InPlaceFigures) if f.name in d})
        if d.get("recovery") == "checkpoint restart":
            record.restart = CheckpointRestart(**{f.name: d[f.name] for f in fields(CheckpointRestart)})
        if "downtime_s" in d:
            record.figures = Figures(detect_s=d["detect_s"], downtime_s=d["downtime_s"],
                                     steps_lost=d["steps_lost"] if record.restart else None,
                                     breakdown_s=d.get("breakdown_s"))
        return record

    def __getitem__(self, key: str):
        """A key of the JSON form: code that reads records from a run folder reads a live one the same way."""
        return self.to_dict()[key]

    def get(self, key: str, default=None):
        return self.to_dict().get(key, default)


_PARTS = {"in_place", "restart", "figures"}
_ALWAYS = {"fault_time", "detect_s", "downtime_s"}
"""Keys the JSON form has even when None."""


def describe_failure(*, rank: int, code: int | None, t_detect: float, attempt: int, generation: int, committed: int,
                     fired: dict | None, lost_node: int | None, node_loss: NodeLoss | None,
                     hung_at: float | None) -> FailureRecord:
    """What failed, when it was caused (if dtk caused it: `fired`, the fault that fired on it) and at which step.
    `code` None: nobody saw the rank exit (it was lost with its node `lost_node`)."""
    if fired is not None:
        fault = fired["kind"]
    elif hung_at is not None:
        fault = "hang"
    elif lost_node is not None or code is None:
        fault = "host lost"
    else:
        fault = "corrupt" if code == CORRUPT_EXIT else signal_name(code)
    record = FailureRecord(rank=rank, exit=f"lost with node {lost_node}" if code is None else signal_name(code),
                           attempt=attempt, generation=generation, detected_at=t_detect, step=committed,
                           committed=committed, fault_time=None, fault=fault)
    if fired is not None:
        record.step, record.fault_time, record.fault_spec = fired["at_step"], fired["time"], fired["id"]
    if lost_node is not None:
        record.node_lost = lost_node
        if node_loss is not None:
            record.detected_by, record.node_silent_s = node_loss.detected_by, node_loss.silent_s
            record.node_address, record.node_refused = node_loss.address, node_loss.refused
    if code == CORRUPT_EXIT:
        record.detected_by = "checksum"
    if hung_at is not None:
        record.detected_by, record.hang_detected_at = "heartbeat", hung_at
    return record


def lost_during_recovery(rank: int, *, like: FailureRecord, attempt: int, generation: int,
                         t_detect: float) -> FailureRecord:
    """A rank that died while the others recovered from `like`'s failure."""
    return FailureRecord(rank=rank, fault="failed during recovery", exit="-", attempt=attempt, generation=generation,
                         detected_at=t_detect, step=like.step, committed=like.committed, fault_time=None)


def _timelines(store: dist.Store, *, attempt: int, world: int) -> list[dict]:
    control = keys.attempt_store(store, attempt)
    return [t for r in range(world) if (t := keys.read_json(control, keys.started(r))) is not None]


def finalize_failures(failures: list[FailureRecord], *, run_dir: Path, store: dist.Store, world: int) -> None:
    """Once the run is over, every failure gets its figures: detection, downtime and its breakdown, steps lost.
    Downtime runs from the fault to the completion, after recovery, of the step the fault interrupted."""
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    for f in failures:
        t_fault = f.fault_time or f.detected_at
        detect_s = f.detected_at - t_fault if f.fault_time else None
        after = [r for r in records if r.get("time", 0) > f.detected_at]
        back = [r for r in after if r["step"] == f.step]
        if not back and f.in_place is not None and not any(r["step"] > f.step for r in after):
            # the run ended at the step it recovered at (a peer lost in the last step's update): it was back once
            # the steps rolled back were redone, or, with none to redo, once the state was repaired
            back = after[-1:] or [{"time": f.in_place.repaired_at}]
        f.figures = Figures(detect_s=detect_s, downtime_s=back[0]["time"] - t_fault if back else None)
        if f.restart is not None:
            f.figures.steps_lost, f.figures.breakdown_s = _restart_cost(f, f.restart, detect_s=detect_s,
                                                                         records=records, store=store, world=world)
        elif f.in_place is not None:
            p, t0 = f.in_place, f.detected_at
            released = min(max(p.released_at, t0), p.plan_at)
            f.figures.breakdown_s = {
                "detect": detect_s or 0.0,
                "release": released - t0,
                "plan": p.plan_at - released,
                "regroup": p.regrouped_at - p.plan_at,
                "state_transfer": p.repaired_at - p.regrouped_at,
                "redo": back[0]["time"] - p.repaired_at if back else 0.0,
            }
        append_event(run_dir, {"event": "failure figures", **f.to_dict()})
        with open(run_dir / "metrics.jsonl", "a") as out:  # rank 0 has stopped writing by now
            out.write(json.dumps({"event": "failure", **f.to_dict()}) + "\n")


def _restart_cost(f: FailureRecord, restart: CheckpointRestart, *, detect_s: float | None, records: list[dict],
                  store: dist.Store, world: int) -> tuple[int, dict[str, float] | None]:
    """A checkpoint restart's steps lost and, when its ranks' start-up timelines are in the store, its breakdown."""
    tl = _timelines(store, attempt=restart.restart_attempt, world=world)
    start_step = tl[0]["start_step"] if tl else restart.checkpoint_step
    if not tl:
        return f.step - start_step, None
    last = lambda key: max(t[key] for t in tl)  # noqa: E731 - the slowest rank sets each stage's end
    ready = last("loaded_at")
    replayed = [r for r in records if start_step <= r["step"] < f.step and r.get("time", 0) > ready]
    return f.step - start_step, {
        "detect": detect_s or 0.0,
        "stop": restart.stopped_at - f.detected_at,
        "process_start": last("main_at") - restart.stopped_at,
        "import": last("imported_at") - last("main_at"),
        "group_init": last("group_at") - last("imported_at"),
        "engine_build": last("engine_at") - last("group_at"),
        "checkpoint_load": ready - last("engine_at"),
        "replay": (max(r["time"] for r in replayed) - ready) if replayed else 0.0,
    }
