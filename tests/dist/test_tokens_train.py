"""Training on prepared token files, with held-out evaluation, as a user runs it: the eval loss is recorded and
falls; a rank killed in the middle of an evaluation (in place) and a checkpoint restart give the losses and the
eval curve of the run without failure, bit for bit; evaluation under DeepSpeed on a user's data.target."""
from __future__ import annotations

import json

import pytest

from conftest import RECIPES, TINY, read_jsonl, run_dtk, train

pytestmark = pytest.mark.dist

CORPUS = RECIPES / "corpus.yaml"
RUN = ["strategy.name=fsdp", "training.steps=12", "eval.every=4", "eval.batches=2"]


def curves(run_dir) -> tuple[list[float], list[tuple[int, float]]]:
    lines = read_jsonl(run_dir / "metrics.jsonl")
    return [r["loss"] for r in lines if "loss" in r], [(r["step"], r["eval_loss"]) for r in lines if "eval_loss" in r]


def faulted(run_dir, *overrides: str, fault: str | list[str]):
    faults = [a for f in ([fault] if isinstance(fault, str) else fault) for a in ("--fault", f)]
    p = run_dtk("train", CORPUS, *TINY, *RUN, *overrides, f"output.dir={run_dir}", "--no-progress", *faults)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = train(tmp_path_factory.mktemp("tokens") / "ref", *RUN, recipe=CORPUS)
    return run_dir, *curves(run_dir)


@pytest.mark.timeout(240)
def test_eval_loss_is_recorded_and_falls(reference):
    run_dir, losses, evals = reference
    assert [s for s, _ in evals] == [3, 7, 11] and evals[-1][1] < evals[0][1], evals
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_loss"] == evals[-1][1] and [e["step"] for e in summary["evals"]] == [3, 7, 11]
    assert summary["eval_perplexity"] == pytest.approx(2.718281828 ** evals[-1][1])
    assert summary["epochs"] == pytest.approx(12 * 2 * 4 / ((2547 - 1) // 16))  # steps x samples / windows


@pytest.mark.timeout(240)
def test_a_rank_killed_in_a_checkpoint_save_or_an_evaluation_recovers_in_place_and_the_run_is_the_same(
        tmp_path, reference):
    _, losses, evals = reference
    run_dir = tmp_path / "inplace"
    # rank 1 dies as it starts saving step_4: rank 0's save gathers from it, is released and must not trust the save
    summary = faulted(run_dir, "resilience.mode=inplace", "checkpoint.every=4",
                      fault=["kill:rank=1,step=4,phase=checkpoint", "kill:rank=1,step=8,phase=eval"])
    assert [f["step"] for f in summary["failures"]] == [4, 8], summary["failures"]
    assert all(f.get("recovery_s") is not None for f in summary["failures"]), summary["failures"]
    assert "the checkpoint of step 4 is not written" in (run_dir / "logs" / "rank0.log").read_text()
    assert curves(run_dir) == (losses, evals)  # the eval at 8 was redone and recorded once
    # the promoted shadow saves too: its rehearsal's DTensor offsets once failed DCP's plan at the first save after
    assert (run_dir / "checkpoints" / "step_12" / "manifest.json").is_file()


@pytest.mark.timeout(240)
def test_a_checkpoint_restart_on_tokens_gives_the_same_run(tmp_path, reference):
    _, losses, evals = reference
    run_dir = tmp_path / "restart"
    summary = faulted(run_dir, "resilience.mode=checkpoint", "checkpoint.every=4", fault="kill:rank=0,step=6")
    assert len(summary["failures"]) == 1
    assert curves(run_dir) == (losses, evals)
