"""Reads a dtk run folder's measured in-place recovery time, for the simulators to use instead of a guess."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from dtk.errors import DtkError


def inplace_recovery_s(run_dir: str | Path, *, flag: str = "--calibrate") -> tuple[float, int]:
    """Median `downtime_s` of the run's in-place failures (every failure not recovered by a checkpoint restart) and
    how many there were. Reads only those two keys, so it keeps working as the summary's other fields change."""
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        raise DtkError(f"{flag}: got {str(run_dir)!r}, which has no summary.json; accepted: a finished dtk run folder")
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DtkError(f"{flag}: {path} is not valid JSON ({e.msg} at line {e.lineno}); accepted: a dtk summary.json")
    failures = summary.get("failures") if isinstance(summary, dict) else None
    if not isinstance(failures, list):
        raise DtkError(f"{flag}: {path} has no `failures` list; accepted: the summary.json of a dtk run")
    downtimes = [f["downtime_s"] for f in failures
                 if isinstance(f, dict) and f.get("recovery") != "checkpoint restart"
                 and isinstance(f.get("downtime_s"), (int, float))]
    if not downtimes:
        raise DtkError(f"{flag}: {run_dir} has no in-place recovery with a measured downtime_s "
                       f"({len(failures)} failures in all); accepted: a run with resilience.mode=inplace and a fault, "
                       f"e.g. from `dtk inject-failure RECIPE resilience.mode=inplace --fault kill:rank=1,step=5`")
    return float(statistics.median(downtimes)), len(downtimes)
