"""In-place recovery's launcher side does not wait for a report that cannot come: a rank that finished the run (its
done key is set) while a peer failed in the final save ends the recovery at once, not after REPORT_TIMEOUT_S."""
from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from dtk.resilience import protocol as keys
from dtk.resilience.recovery import Recovery, RecoveryFailed


class _Run:
    """A RunView over a real store: rank 1 failed, rank 0 finished the run; replacements are only counted."""

    def __init__(self, tmp: Path):
        self.control: dist.Store = dist.HashStore()
        self.control.set_timeout(timedelta(seconds=5))
        self.generation, self.run_dir, self.replaced = 0, tmp, []

    def ranks(self) -> list[int]:
        return [0, 1]

    def dead(self) -> list[int]:
        return []

    def replace(self, rank: int, generation: int) -> dict:
        self.replaced.append(rank)
        return {"replacement": "cold"}


def test_a_rank_that_finished_the_run_ends_the_recovery_at_once(tmp_path):
    run = _Run(tmp_path)
    run.control.set(keys.done(0), "{}")
    with pytest.raises(RecoveryFailed, match=r"rank\(s\) \[0\] finished the run"):
        Recovery(run=run, t_detect=time.time()).run_rounds({1})
    assert run.replaced == [1]  # (before: "recovery stalled: no failed report from rank(s) [0] in 300s")
