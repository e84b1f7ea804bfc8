"""Real ranks on gloo through `dtk train`: the strategies agree, resume is exact, bf16 trains, the run folder
holds what it should, and a failing rank fails the run loudly."""
from __future__ import annotations

import json
import os

import pytest
import yaml

from conftest import RECIPES, losses, read_jsonl, run_dtk, train

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

STEPS = 20
FULL = os.environ.get("DTK_CHAOS_FULL") == "1"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One fp32 run of STEPS steps per strategy, made on first use and shared by the tests of this module."""
    runs = {}

    def get(strategy: str):
        if strategy not in runs:
            run_dir = tmp_path_factory.mktemp(f"{strategy}-fp32") / "run"
            runs[strategy] = train(run_dir, f"strategy.name={strategy}", f"training.steps={STEPS}")
        return runs[strategy]

    return get


def assert_falls(values: list[float]) -> None:
    assert len(values) == STEPS
    assert values[-1] < values[0], values


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero1", "zero2", "zero3"])
def test_strategy_matches_ddp_and_loss_falls(uninterrupted, strategy):
    got = losses(uninterrupted(strategy))
    assert_falls(got)
    want = losses(uninterrupted("ddp"))
    assert got == pytest.approx(want, rel=1e-5), f"{strategy} vs ddp"


# The user's resume (a second `dtk train` in the same folder). Each strategy's checkpoint load is also what the
# launcher's restarts of tests/dist/test_faults.py run (ddp, fsdp, zero2, zero3), so by default one strategy runs
# here; DTK_CHAOS_FULL=1 adds fsdp and zero2.
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2"] if FULL else ["ddp"])
def test_resume_from_checkpoint_reproduces_the_uninterrupted_losses(uninterrupted, tmp_path, strategy):
    want = losses(uninterrupted(strategy))
    run_dir = tmp_path / "run"
    # first attempt: stops after step 12; checkpoints after steps 5 and 10
    train(run_dir, f"strategy.name={strategy}", "checkpoint.every=5", "training.steps=12")
    assert (run_dir / "checkpoints" / "step_10").is_dir()
    assert len(losses(run_dir)) == 12
    # second attempt in the same folder: resumes from step 10 (checkpoint.resume: auto), redoes 10 and 11
    train(run_dir, f"strategy.name={strategy}", f"training.steps={STEPS}")
    assert "at step 10" in (run_dir / "logs" / "rank0.log").read_text()
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert [r["loss"] for r in records] == want  # exactly: CPU/gloo is deterministic


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_bf16_trains(tmp_path, strategy):
    run_dir = train(tmp_path / "run", f"strategy.name={strategy}", "training.precision=bf16",
                    f"training.steps={STEPS}")
    assert_falls(losses(run_dir))
    assert yaml.safe_load((run_dir / "recipe.yaml").read_text())["training"]["precision"] == "bf16"


@pytest.mark.parametrize("strategy, kinds", [("ddp", ["all_reduce"]), ("zero3", ["all_gather", "reduce_scatter"])])
def test_run_folder_holds_recipe_metrics_summary_and_logs(uninterrupted, strategy, kinds):
    run_dir = uninterrupted(strategy)
    recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    assert recipe["strategy"]["name"] == strategy and recipe["training"]["steps"] == STEPS
    assert recipe["output"]["dir"] == str(run_dir)

    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(isinstance(r["loss"], float) for r in records)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["losses"] == [r["loss"] for r in records]
    comm = summary["comm"]
    assert comm["bytes_per_step"] > 0
    for kind in kinds:
        assert comm["by_kind"][kind]["bytes_per_step"] > 0, comm["by_kind"]
    assert comm["bytes_per_step"] == pytest.approx(sum(v["bytes_per_step"] for v in comm["by_kind"].values()))

    for rank in (0, 1):
        assert (run_dir / "logs" / f"rank{rank}.log").is_file()


def test_a_failing_rank_fails_the_run_and_shows_its_log(tmp_path):
    run_dir = tmp_path / "run"
    p = run_dtk("train", RECIPES / "quickstart.yaml", "data.seq_len=16", "data.vocab_size=32",
                "training.micro_batch=4", "world.nproc=2", "training.steps=20",
                "model.target=tests.fixtures.bad_model:build", f"output.dir={run_dir}", "--no-progress")
    assert p.returncode not in (0, 2), f"exit {p.returncode}\n{p.stderr}"
    assert "rank 1 failed" in p.stderr, p.stderr
    assert "deliberate failure on rank 1" in p.stderr, "the failed rank's last log lines are shown"
    assert "rank1.log" in p.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert [f["rank"] for f in summary["failures"]] == [1]
