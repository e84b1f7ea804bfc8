"""Real ranks on gloo through `dtk train`: the strategies agree, resume is exact, bf16 trains, the run folder
holds what it should, and a failing rank fails the run loudly."""
from __future__ import annotations

import json
import os

import pytest
import yaml

from conftest import RECIPES, TINY, losses, read_jsonl, run_dtk, train

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

STEPS = 20
FULL = os.environ.get("DTK_CHAOS_FULL") == "1"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One fp32 run of STEPS steps per strategy (and overrides), made on first use and shared by this module's tests."""
    runs = {}

    def get(strategy: str, *overrides: str):
        if (strategy, *overrides) not in runs:
            run_dir = tmp_path_factory.mktemp(f"{strategy}-fp32") / "run"
            runs[strategy, *overrides] = train(run_dir, f"strategy.name={strategy}", f"training.steps={STEPS}",
                                               *overrides)
        return runs[strategy, *overrides]

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


# The user's resume (a second `dtk train` in the same folder), with dropout: the RNG follows (seed, step, rank), so
# a resumed run draws what the uninterrupted one drew. Each strategy's checkpoint load is also what the launcher's
# restarts of tests/dist/test_faults.py run (ddp, fsdp, zero2, zero3), so by default one strategy runs here;
# DTK_CHAOS_FULL=1 adds fsdp and zero2.
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2"] if FULL else ["ddp"])
def test_resume_from_checkpoint_reproduces_the_uninterrupted_losses(uninterrupted, tmp_path, strategy):
    want = losses(uninterrupted(strategy, "model.dropout=0.1"))
    assert want != losses(uninterrupted(strategy)) if strategy == "ddp" else True  # the dropout is real
    run_dir = tmp_path / "run"
    # first attempt: stops after step 12; checkpoints after steps 5 and 10, each with its manifest
    train(run_dir, f"strategy.name={strategy}", "checkpoint.every=5", "training.steps=12", "model.dropout=0.1")
    assert (run_dir / "checkpoints" / "step_10" / "manifest.json").is_file()
    assert len(losses(run_dir)) == 12
    # the newest checkpoint is damaged since (a shard cut short): the resume falls back to step 5, and says so
    shard = sorted((run_dir / "checkpoints" / "step_10").glob("*.distcp"))[-1]
    os.truncate(shard, shard.stat().st_size - 100)
    # second attempt in the same folder: resumes from step 5 (checkpoint.resume: auto), redoes 5..11
    p = run_dtk("train", RECIPES / "quickstart.yaml", *TINY, f"output.dir={run_dir}", f"strategy.name={strategy}",
                f"training.steps={STEPS}", "model.dropout=0.1", "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    [note] = [line for line in p.stderr.splitlines() if line.startswith("note: ")]
    assert note.startswith(f"note: resuming from the checkpoint of step 5 ({run_dir / 'checkpoints' / 'step_5'}): "
                           f"the newer one cannot be trusted: step_10: ") and f"lacks {shard.name}" in note
    assert "at step 5" in (run_dir / "logs" / "rank0.log").read_text()
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert [r["loss"] for r in records] == want  # exactly: CPU/gloo is deterministic


# ddp keeps fp32 weights under bf16 autocast; ZeRO-1/2 hold bf16 weights (fp32 masters in the optimizer). fsdp and
# zero3 in bf16: tests/dist/test_meta_init.py
@pytest.mark.parametrize("strategy, weights", [("ddp", "float32"), ("zero2", "bfloat16")])
def test_bf16_trains_near_fp32_in_the_dtypes_summary_names(uninterrupted, tmp_path, strategy, weights):
    run_dir = train(tmp_path / "run", f"strategy.name={strategy}", "training.precision=bf16",
                    f"training.steps={STEPS}")
    got = losses(run_dir)
    assert_falls(got)
    assert yaml.safe_load((run_dir / "recipe.yaml").read_text())["training"]["precision"] == "bf16"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dtypes"] == {"weights": weights, "activations": "bfloat16", "master": "float32"}, summary
    fp32 = losses(uninterrupted(strategy))
    assert got != fp32 and got == pytest.approx(fp32, rel=2e-2)


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
    assert summary["dtypes"] == {"weights": "float32", "activations": "float32", "master": "float32"}
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
