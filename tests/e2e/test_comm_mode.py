"""`comm.mode: adaptive` through dtk train: with no congestion the plan stays native, nothing is logged, and the
losses are those of comm.mode native."""
from __future__ import annotations

import pytest

from tests.conftest import losses, read_jsonl, run_dtk, train

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_adaptive_without_congestion_keeps_native_and_the_losses(tmp_path, strategy):
    common = [f"strategy.name={strategy}", "training.steps=4"]
    native = train(tmp_path / "native", *common, "comm.mode=native")
    adaptive = train(tmp_path / "adaptive", *common, "comm.mode=adaptive")
    assert losses(adaptive) == pytest.approx(losses(native), rel=1e-6)
    events = tmp_path / "adaptive" / "events.jsonl"
    plans = [e for e in read_jsonl(events) if e.get("event") == "comm_plan"] if events.exists() else []
    assert plans == []


def test_bad_comm_mode_is_one_line_error(tmp_path):
    p = run_dtk("validate", "recipes/quickstart.yaml", "comm.mode=fast", timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip() == "error: comm.mode: got 'fast'; input should be 'native' or 'adaptive'"
