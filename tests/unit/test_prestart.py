"""A prestarted rank (dtk.prestart) whose imports fail: the traceback lands in the log of the rank it was handed,
as it would for a rank started the usual way, and it exits non-zero. One real process, no launcher."""
from __future__ import annotations

import os

from dtk.prestart import Prestarted

BROKEN = os.path.join(os.path.dirname(__file__), "..", "fixtures", "broken_deepspeed")


def test_an_import_that_fails_in_a_prestarted_rank_is_raised_in_that_ranks_log(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([BROKEN, os.environ.get("PYTHONPATH", "")]))
    pool = Prestarted(1, threads_per_rank=1, device="cpu", deepspeed=True)
    log = tmp_path / "rank0.log"
    try:
        # handed over while it still imports: the failure waits for the order, then goes to the rank's log
        proc = pool.hand_over(dict(os.environ), str(log))
        assert proc is not None
        assert proc.wait(timeout=120) == 1
    finally:
        pool.close()
    text = log.read_text()
    assert "ImportError: this deepspeed is broken on purpose" in text and "Traceback" in text, text
