"""`dtk compare` as a user runs it: the files it writes, the figures in them (bytes against the ZeRO paper,
loss parity, memory ordering), and the one-line errors for bad flags."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import RECIPES, TINY, read_jsonl, run_dtk

pytestmark = pytest.mark.e2e

QUICKSTART = RECIPES / "quickstart.yaml"
RECORD_KEYS = ("variant", "throughput", "step_time_p50", "step_time_p95", "peak_memory_bytes",
               "model_state_bytes_analytic", "comm_bytes_per_step", "comm_bytes_per_step_analytic", "final_loss",
               "max_rel_loss_diff")


def _compare(out: Path, *args: str, timeout: float = 480):
    return run_dtk("compare", QUICKSTART, *args, "--out", out, "--no-progress", timeout=timeout)


def _explain(p) -> str:
    return f"exit {p.returncode}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"


@pytest.mark.timeout(600)
def test_compare_strategies_writes_every_file_with_sane_figures(tmp_path):
    out = tmp_path / "cmp"
    # the last variant trains with another learning rate: the only one that breaks parity
    # on a user's data set (data.target, the same vocabulary and context as TINY's) with a held-out eval
    p = _compare(out, *TINY, "training.steps=6", "data.target=tests.fixtures.data_target:counting", "eval.every=3",
                 "eval.batches=1", "--strategies", "ddp,fsdp,zero3",
                 "--variant", "lr:optimizer.lr=0.01", "--assert-parity", "1e-5")
    assert p.returncode == 1, _explain(p)
    assert "parity broken: lr differs from ddp" in p.stdout
    assert "parity broken: zero3" not in p.stdout and "parity broken: fsdp" not in p.stdout

    doc = json.loads((out / "compare.json").read_text())
    by_name = {v["variant"]: v for v in doc["variants"]}
    assert list(by_name) == ["ddp", "fsdp", "zero3", "lr"]
    for name, v in by_name.items():
        assert all(v[k] is not None for k in RECORD_KEYS), (name, v)
        assert v["status"] == "completed"
        run_dir = out / name
        summary = json.loads((run_dir / "summary.json").read_text())
        assert len([r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]) == 6
        assert v["final_loss"] == summary["final_loss"] and len(v["losses"]) == 6
        recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text())
        assert (recipe["training"]["seed"], recipe["training"]["steps"]) == (0, 6)
        assert recipe["data"] == yaml.safe_load((out / "ddp" / "recipe.yaml").read_text())["data"]
        assert v["throughput"] > 0 and 0 < v["step_time_p50"] <= v["step_time_p95"]
        assert v["peak_memory_bytes"] > 0

    # every strategy evaluates the same model on the same held-out batches: the same eval loss; the table shows it
    evals = [by_name[n]["eval_loss"] for n in ("ddp", "fsdp", "zero3")]
    assert all(e == pytest.approx(evals[0], rel=1e-5) for e in evals) and by_name["lr"]["eval_loss"] != evals[0]
    assert "eval loss" in (out / "compare.md").read_text()
    psi = by_name["ddp"]["params"]
    assert psi > 0 and all(v["params"] == psi for v in by_name.values())
    # model states per rank, fp32 AdamW on N=2: DDP 16Ψ, FSDP2 16Ψ/N, DeepSpeed ZeRO-3 20Ψ/N (its fp32 master
    # copy); measured from the tensors within 10%, and the memory verdict follows them
    assert by_name["ddp"]["model_state_bytes_analytic"] == 16 * psi
    assert by_name["fsdp"]["model_state_bytes_analytic"] == 8 * psi
    assert by_name["zero3"]["model_state_bytes_analytic"] == 10 * psi
    for name in ("ddp", "fsdp", "zero3"):
        v = by_name[name]
        assert v["model_state_bytes"] == pytest.approx(v["model_state_bytes_analytic"], rel=0.1), name
    assert doc["verdict"]["leanest_memory"] == "fsdp"
    # bytes on the wire: DDP 2Ψ·4·(N−1)/N, ZeRO-3/FSDP 3Ψ·4·(N−1)/N; measured matches, and ZeRO-3 moves 1.5x DDP
    assert by_name["ddp"]["comm_bytes_per_step_analytic"] == 2 * psi * 4 / 2
    for name in ("ddp", "fsdp", "zero3"):
        v = by_name[name]
        assert v["comm_bytes_per_step"] == pytest.approx(v["comm_bytes_per_step_analytic"], rel=0.1), name
    ratio = by_name["zero3"]["comm_bytes_per_step"] / by_name["ddp"]["comm_bytes_per_step"]
    assert ratio == pytest.approx(1.5, rel=0.1)
    assert by_name["fsdp"]["comm_bytes_per_step"] / by_name["ddp"]["comm_bytes_per_step"] == pytest.approx(1.5, rel=0.1)
    # parity in fp32: the same losses under every strategy; another learning rate shows
    assert by_name["ddp"]["max_rel_loss_diff"] == 0.0
    assert by_name["fsdp"]["max_rel_loss_diff"] <= 1e-5 and by_name["zero3"]["max_rel_loss_diff"] <= 1e-5
    assert by_name["lr"]["max_rel_loss_diff"] > 1e-3
    assert set(doc["verdict"]) == {"fastest", "leanest_memory", "least_traffic"}

    # the printed table and the markdown copy
    for text in (p.stdout, (out / "compare.md").read_text()):
        text = " ".join(text.split())  # the terminal table wraps its caption at the console width
        for name in by_name:
            assert name in text
        assert "training.untimed_steps" in text and "model states" in text and "verdict: fastest" in text
    md = (out / "compare.md").read_text()
    assert md.count("\n| ") == 1 + len(by_name)  # header + one row per variant
    assert "16Ψ/N" in md and "3Ψ" in md

    png = (out / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


@pytest.mark.timeout(600)
def test_compare_memory_ordering_follows_the_analytic_one_on_a_large_model(tmp_path):
    # ~50M parameters: model states (16Ψ = 800 MB for DDP) dominate what each rank's process holds
    big = ["model.layers=4", "model.width=1024", "model.heads=4", "data.seq_len=16", "data.vocab_size=32",
           "training.micro_batch=4", "training.steps=3", "training.untimed_steps=1"]
    p = _compare(tmp_path / "mem", *big, "--strategies", "ddp,fsdp")
    assert p.returncode == 0, _explain(p)
    ddp, fsdp = json.loads((tmp_path / "mem" / "compare.json").read_text())["variants"]
    assert ddp["model_state_bytes_analytic"] > fsdp["model_state_bytes_analytic"]
    assert ddp["peak_memory_bytes"] > fsdp["peak_memory_bytes"], (ddp["peak_memory_bytes"], fsdp["peak_memory_bytes"])


@pytest.mark.parametrize("args, names", [
    (["--strategies", "ddp,foo"], ["--strategies", "'foo'", "zero3"]),
    (["--strategies", "ddp"], ["--strategies/--variant", "two or more"]),
    (["--variant", "nocolon", "--variant", "b:"], ["--variant", "'nocolon'", "NAME:key=value"]),
    (["--strategies", "ddp,zero3", "--variant", "s:training.seed=3"], ["--variant", "'training.seed'", "shares"]),
    (["--variant", "a:strategy.name=bar", "--variant", "b:"], ["--variant a:strategy.name=bar", "strategy.name", "'zero3'"]),
    (["--strategies", "ddp,fsdp", "--mtbf", "fast"], ["--mtbf", "'fast'", "30s"]),
    (["--strategies", "ddp,fsdp", "--mtbf", "5s", "--mtbf-fault", "nope"], ["--mtbf-fault", "'nope'", "kill"]),
])
def test_compare_rejects_bad_flags_with_one_line(tmp_path, args, names):
    p = _compare(tmp_path / "cmp", *args, timeout=60)
    assert p.returncode == 2, _explain(p)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in p.stderr, p.stderr
    for word in names:
        assert word in lines[0], (word, lines[0])
    assert not (tmp_path / "cmp").exists()


def test_compare_refuses_a_folder_that_holds_something(tmp_path):
    (tmp_path / "cmp").mkdir()
    (tmp_path / "cmp" / "old.txt").write_text("x")
    p = _compare(tmp_path / "cmp", "--strategies", "ddp,zero3", timeout=60)
    assert p.returncode == 2 and "--out" in p.stderr and "not empty" in p.stderr, _explain(p)


@pytest.mark.timeout(600)
def test_compare_with_a_fault_sets_recovery_layers_side_by_side(tmp_path):
    out = tmp_path / "cmp"
    p = _compare(out, *TINY, "training.steps=14", "--variant", "ckpt:resilience.mode=checkpoint,checkpoint.every=5",
                 "--variant", "inplace:resilience.mode=inplace", "--fault", "kill:rank=1,step=12",
                 "--assert-parity", "0")
    assert p.returncode == 0, _explain(p)
    doc = json.loads((out / "compare.json").read_text())
    assert doc["faults"] == ["kill:rank=1,step=12"]
    ckpt, inplace = doc["variants"]
    assert (ckpt["failures"], inplace["failures"]) == (1, 1)
    assert (ckpt["steps_lost"], inplace["steps_lost"]) == (2, 0)
    assert ckpt["downtime_s"] > 0 and inplace["downtime_s"] > 0
    assert 0 < inplace["productive_time_ratio"] < 1 and inplace["max_rel_loss_diff"] == 0
    for header in ("downtime", "steps", "productive"):
        assert header in p.stdout and header in (out / "compare.md").read_text()
    assert (out / "compare.png").stat().st_size > 0
