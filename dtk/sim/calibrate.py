"""Reads a dtk run folder's measured in-place figures (recovery downtime, protection cost), for the simulators to
use instead of a guess."""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from dtk.errors import DtkError


def _summary(run_dir: str | Path, flag: str) -> dict:
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        raise DtkError(f"{flag}: got {str(run_dir)!r}, which has no summary.json; accepted: a finished dtk run folder")
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DtkError(f"{flag}: {path} is not valid JSON ({e.msg} at line {e.lineno}); accepted: a dtk summary.json")
    if not isinstance(summary, dict):
        raise DtkError(f"{flag}: {path} is not a dtk summary (a JSON object); accepted: the summary.json of a dtk run")
    return summary


def inplace_recovery_s(run_dir: str | Path, *, flag: str = "--calibrate") -> tuple[float, int]:
    """Median `downtime_s` of the run's in-place failures (every failure not recovered by a checkpoint restart) and
    how many there were. Reads only those two keys, so it keeps working as the summary's other fields change."""
    failures = _summary(run_dir, flag).get("failures")
    if not isinstance(failures, list):
        raise DtkError(f"{flag}: {Path(run_dir) / 'summary.json'} has no `failures` list; accepted: the summary.json "
                       f"of a dtk run")
    downtimes = [f["downtime_s"] for f in failures
                 if isinstance(f, dict) and f.get("recovery") != "checkpoint restart"
                 and isinstance(f.get("downtime_s"), (int, float))]
    if not downtimes:
        raise DtkError(f"{flag}: {run_dir} has no in-place recovery with a measured downtime_s "
                       f"({len(failures)} failures in all); accepted: a run with resilience.mode=inplace and a fault, "
                       f"e.g. from `dtk inject-failure RECIPE resilience.mode=inplace --fault kill:rank=1,step=5`")
    return float(statistics.median(downtimes)), len(downtimes)


@dataclass(frozen=True, kw_only=True)
class Calibration:
    recovery_s: float
    recoveries: int
    protection_cost: float
    """Share of the steady-state throughput the protection takes (0.1 = 10% fewer steps per second)."""
    cost_source: str


def _throughput(summary: dict, run_dir: str | Path, flag: str) -> float:
    value = summary.get("throughput")
    if not isinstance(value, (int, float)) or value <= 0:
        raise DtkError(f"{flag}: {run_dir} has no measured throughput in summary.json; accepted: a finished dtk run")
    return float(value)


def calibrate_inplace(run_dir: str | Path, *, baseline: str | Path | None = None) -> Calibration:
    """The run's median in-place downtime and what its protection costs in steady state. With `baseline` (the same
    recipe without protection, e.g. resilience.mode=none) the cost is the throughput lost against it. Without, it
    is the protection's own time (the parity keeper's seconds) over the run's step time: what it costs where it
    cannot overlap training, so it leans toward charging in place too much rather than too little; the part the
    trainer waited for (stall_s) is the lower bound, said beside it."""
    recovery_s, count = inplace_recovery_s(run_dir)
    summary = _summary(run_dir, "--calibrate")
    if baseline is not None:
        base = _throughput(_summary(baseline, "--calibrate-baseline"), baseline, "--calibrate-baseline")
        ratio = _throughput(summary, run_dir, "--calibrate") / base
        return Calibration(recovery_s=recovery_s, recoveries=count, protection_cost=max(0.0, 1.0 - ratio),
                           cost_source=f"throughput {ratio:.3f}x of the unprotected run {baseline}")
    totals = ((summary.get("parity") or {}).get("exchange") or {}).get("totals") or {}
    busy, stall = totals.get("seconds"), totals.get("stall_s")
    steps, step_s = summary.get("steps"), summary.get("step_time_p50")
    if not all(isinstance(v, (int, float)) for v in (busy, stall, steps, step_s)) or not steps or not step_s:
        return Calibration(recovery_s=recovery_s, recoveries=count, protection_cost=0.0,
                           cost_source=f"none measured in {run_dir} (no parity figures: a replicated strategy's "
                                       f"state needs none); give --calibrate-baseline for the throughput cost")
    total = steps * step_s
    return Calibration(recovery_s=recovery_s, recoveries=count, protection_cost=min(0.99, busy / total),
                       cost_source=f"parity work {busy:.2f} s over {steps} steps of {step_s * 1000:.0f} ms in {run_dir}, "
                                   f"not overlapped (waited for: {stall / total:.1%}, the lower bound); "
                                   f"--calibrate-baseline measures the throughput lost")
