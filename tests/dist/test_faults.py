"""dtk inject-failure and the checkpoint-restart baseline: real faults (SIGKILL, a hung rank, a bit flip) on real
ranks; the run recovers from its last checkpoint and its losses equal, bit for bit, those of the run without."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import RECIPES, ROOT, TINY, dtk_env, losses, read_jsonl, run_dtk

pytestmark = [pytest.mark.dist]
STEPS, EVERY, AT = 16, 5, 12
# a cosine schedule with warmup and weight-decay groups: the restart sets the rate of each step as the run without
BASE = [f"training.steps={STEPS}", f"checkpoint.every={EVERY}", "optimizer.schedule=cosine", "optimizer.warmup_steps=3",
        "optimizer.weight_decay=0.1"]
FULL = os.environ.get("DTK_CHAOS_FULL") == "1"
ALL = ["ddp", "fsdp", "zero2", "zero3"]
CASES = [("kill", 3, ALL if FULL else ["ddp", "zero3"]), ("hang", 2, ALL if FULL else ["fsdp", "zero2"])]
"""Each strategy restarts from a checkpoint once, and each fault hits a replicated and a sharded strategy; the
other four cells repeat the same restart path (DTK_CHAOS_FULL=1 runs them too, ~80 s more)."""


def inject(run_dir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_dtk("inject-failure", RECIPES / "quickstart.yaml", *TINY, *BASE, f"output.dir={run_dir}", *args,
                   "--no-progress", timeout=timeout)


@pytest.fixture
def references(reference_losses):
    """The run without faults of a strategy and rank count (checkpointing too: it must not change the losses)."""
    return lambda strategy, nproc: reference_losses(*BASE, f"strategy.name={strategy}", f"world.nproc={nproc}")


# 3 ranks: a sum of three numbers depends on its order, so a restart that reduces otherwise shows (2 ranks hide it)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault, nproc, strategy", [
    (fault, nproc, strategy) for fault, nproc, strategies in CASES for strategy in strategies])
def test_fault_recovered_from_checkpoint_with_same_losses(tmp_path, references, strategy, fault, nproc):
    run_dir = tmp_path / "run"
    p = inject(run_dir, f"strategy.name={strategy}", f"world.nproc={nproc}", "resilience.mode=checkpoint",
               "resilience.heartbeat_timeout_s=2", "--fault", f"{fault}:rank=1,step={AT}")
    assert p.returncode == 0, p.stdout + p.stderr
    assert losses(run_dir) == references(strategy, nproc)
    summary = json.loads((run_dir / "summary.json").read_text())
    [f] = summary["failures"]
    assert (f["fault"], f["rank"], f["step"]) == (fault, 1, AT)
    assert f["steps_lost"] == AT - (AT // EVERY) * EVERY
    assert f["detect_s"] is not None and f["downtime_s"] > f["detect_s"] >= 0
    assert set(f["breakdown_s"]) >= {"detect", "stop", "process_start", "import", "group_init", "engine_build",
                                      "checkpoint_load", "replay"}
    assert 0 < summary["productive_time_ratio"] < 1
    if fault == "hang":
        assert f["detected_by"] == "heartbeat"
    # the report a user reads
    assert "recovery report" in p.stdout and "productive time ratio" in p.stdout
    events = [e for e in read_jsonl(run_dir / "metrics.jsonl") if e.get("event") == "failure"]
    assert len(events) == 1 and events[0]["steps_lost"] == f["steps_lost"]


@pytest.mark.timeout(300)
def test_corrupt_state_is_caught_by_checksum_and_not_trained_on(tmp_path, references):
    # without recovery the run stops and says why (and that a later fault never fired: nothing tested it); with the
    # baseline it is repaired from the checkpoint (and random faults a run never meets are said to have not fired)
    stopped = inject(tmp_path / "none", "--fault", "corrupt:rank=1,step=7", "--fault", "kill:rank=0,step=12")
    assert stopped.returncode == 1
    assert "rank 1 failed (corrupt)" in stopped.stderr and "checksum mismatch" in stopped.stderr
    assert len(losses(tmp_path / "none")) == 7  # nothing was trained on the flipped bit
    assert "not fired: kill:rank=0,step=12 (the run ended before it came due)" in stopped.stdout
    assert "not fired: corrupt" not in stopped.stdout

    repaired = inject(tmp_path / "ckpt", "resilience.mode=checkpoint", "--fault", "corrupt:rank=1,step=7",
                      "--mtbf", "1000h")
    assert repaired.returncode == 0, repaired.stderr
    assert "--mtbf 1000h: no random fault fired: every one came due outside training" in repaired.stdout
    assert json.loads((tmp_path / "ckpt" / "summary.json").read_text())["faults_fired"] == ["f0"]
    [f] = json.loads((tmp_path / "ckpt" / "summary.json").read_text())["failures"]
    assert (f["fault"], f["detected_by"], f["steps_lost"]) == ("corrupt", "checksum", 2)
    assert losses(tmp_path / "ckpt") == references("ddp", 2)


@pytest.mark.timeout(300)
def test_fault_aimed_at_a_running_train(tmp_path):
    run_dir = tmp_path / "live"
    cmd = [sys.executable, "-m", "dtk.cli", "train", str(RECIPES / "quickstart.yaml"), *TINY, "training.steps=400",
           "checkpoint.every=5", "resilience.mode=checkpoint", f"output.dir={run_dir}", "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dtk_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        token = run_dir / "control.json"
        assert token.stat().st_mode & 0o777 == 0o600
        bad = run_dtk("inject-failure", "--run", run_dir, "kill:rank=5")
        assert bad.returncode == 2 and bad.stderr.startswith("error: fault: got rank=5")
        ok = run_dtk("inject-failure", "--run", run_dir, "kill:rank=1")
        assert ok.returncode == 0, ok.stderr
        assert "scheduled: kill:rank=1" in ok.stdout
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    [f] = json.loads((run_dir / "summary.json").read_text())["failures"]
    assert (f["fault"], f["rank"]) == ("kill", 1)
    assert not (run_dir / "control.json").exists()


@pytest.mark.parametrize("args, message", [
    (["--fault", "explode:rank=1,step=2"], "error: --fault: got 'explode:rank=1,step=2'; the fault must be one of"),
    (["--fault", "kill:rank=9,step=2"], "error: --fault: got rank=9"),
    (["--fault", "kill:rank=1,step=x"], "error: --fault: got 'kill:rank=1,step=x'"),
    (["--fault", "kill:rank=1,phase=sideways"], "error: --fault: got phase='sideways'"),
    (["--fault", "stall:rank=1,seconds=0"], "error: --fault: got seconds=0"),
    (["--mtbf", "soon"], "error: --mtbf: got 'soon'"),
    ([], "error: --fault: none given"),
])
def test_bad_fault_flags_are_one_line_errors(tmp_path, args, message):
    p = inject(tmp_path / "run", *args)
    assert p.returncode == 2 and p.stderr.startswith(message), p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_checkpoint_mode_needs_checkpoints(tmp_path):
    p = run_dtk("train", RECIPES / "quickstart.yaml", "resilience.mode=checkpoint", f"output.dir={tmp_path}/r")
    assert p.returncode == 2 and "checkpoint.every" in p.stderr
