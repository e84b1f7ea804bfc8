"""A model at the end of a run, and `dtk export`, as a user runs them: zero3 on 3 ranks trains a transformers GPT-2;
final/ and the exported files load in plain transformers (no dtk) and in dtk's model with the weights the run
trained (the loss they give on a step's batches is the loss the run recorded); the loggers' files hold
metrics.jsonl's numbers; bad input is one line, exit 2. (The built-in gpt's export: tests/dist/test_reshard.py.)"""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import RECIPES, ROOT, dtk_env, read_jsonl, run_dtk
from test_cli_errors import assert_user_error

pytestmark = pytest.mark.e2e
STEPS, EVERY = 5, 4
COMMON = ["data.seq_len=16", "data.vocab_size=32", "training.micro_batch=4", "world.nproc=3",
          "strategy.name=zero3", f"training.steps={STEPS}", f"checkpoint.every={EVERY}", "optimizer.schedule=cosine",
          "optimizer.warmup_steps=1", "optimizer.weight_decay=0.1", "--no-progress"]
HF = ["model.hf.model_type=gpt2", "model.hf.config.n_layer=1", "model.hf.config.n_embd=32", "model.hf.config.n_head=2",
      "model.hf.config.resid_pdrop=0", "model.hf.config.embd_pdrop=0", "model.hf.config.attn_pdrop=0"]  # no dropout:
# the recorded loss is then the loss of the weights alone
OPTIONAL = [name for name in ("wandb", "mlflow") if __import__("importlib").util.find_spec(name)]
LOGGERS = ["jsonl", "tensorboard", "csv", *OPTIONAL]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("export")
    out = {}
    for name, model, extra in [("hf", HF, [f"output.loggers=[{','.join(LOGGERS)}]"])]:
        run_dir = root / name
        p = run_dtk("train", RECIPES / "quickstart.yaml", *model, *COMMON, *extra, f"output.dir={run_dir}",
                    timeout=300)
        assert p.returncode == 0, p.stderr[-3000:] + (run_dir / "logs" / "rank0.log").read_text()[-3000:]
        out[name] = run_dir
    return out


def _dtk_model(run_dir: Path):
    from dtk import recipe
    from dtk.data import build_dataset
    from dtk.models import build_model

    r = recipe.load(run_dir / "recipe.yaml")
    data = build_dataset(r.data, seed=0)
    return build_model(r.model, data.spec, seed=1).eval(), data, r  # another seed: every weight must come from the file


def _logits(model, x):
    from dtk.strategies.base import logits_of

    with torch.no_grad():
        return logits_of(model(x))


@pytest.mark.timeout(600)
def test_exported_weights_are_the_trained_ones(runs, tmp_path):
    """The checkpoint of step 4, exported on one process, gives on step 4's batches of the 3 ranks the loss the run
    recorded for step 4 (a model that holds other weights would not)."""
    from safetensors.torch import load_model

    from dtk.strategies.base import loss_fn

    run_dir = runs["hf"]
    p = run_dtk("export", run_dir, "--step", str(EVERY), "--out", tmp_path / "st")
    assert p.returncode == 0 and "exported" in p.stdout, p.stderr
    model, data, r = _dtk_model(run_dir)
    load_model(model, str(tmp_path / "st" / "model.safetensors"))
    batches = [data.batch(step=EVERY, rank=rank, micro=0, size=4) for rank in range(3)]
    with torch.no_grad():
        loss = sum(float(loss_fn(model(x), y)) for x, y in batches) / 3
    [record] = [x for x in read_jsonl(run_dir / "metrics.jsonl") if x.get("step") == EVERY]
    assert loss == pytest.approx(record["loss"], rel=1e-6, abs=1e-6)
    # torch format: the same tensors
    assert run_dtk("export", run_dir, "--step", str(EVERY), "--format", "torch", "--out", tmp_path / "pt").returncode == 0
    state = torch.load(tmp_path / "pt" / "model.pt")
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert (tmp_path / "pt" / "recipe.yaml").read_text() == (run_dir / "recipe.yaml").read_text()
    assert sorted(p.name for p in (run_dir / "final").iterdir()) == ["hf", "model.safetensors", "recipe.yaml"]


@pytest.mark.timeout(300)
def test_plain_transformers_loads_the_final_folder_with_the_same_logits(runs, tmp_path):
    from safetensors.torch import load_model

    final = runs["hf"] / "final"
    x = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(3))
    torch.save(x, tmp_path / "x.pt")
    code = ("import sys, torch; from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({str(final / 'hf')!r}).eval(); "
            f"torch.save(m(torch.load({str(tmp_path / 'x.pt')!r})).logits.detach(), {str(tmp_path / 'y.pt')!r}); "
            "assert not any(n == 'dtk' or n.startswith('dtk.') for n in sys.modules), 'dtk was imported'")
    env = {k: v for k, v in dtk_env().items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=200, env=env,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    model, _, _ = _dtk_model(runs["hf"])
    load_model(model, str(final / "model.safetensors"))
    assert (torch.load(tmp_path / "y.pt") - _logits(model, x)).abs().max().item() <= 1e-6
    p = run_dtk("export", runs["hf"], "--format", "hf", "--out", tmp_path / "hf")  # default: the final model
    assert p.returncode == 0 and str(final) in p.stdout, p.stderr
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()


def test_every_logger_holds_the_losses_of_metrics_jsonl(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = runs["hf"]
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    want = [r["loss"] for r in records]
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(STEPS))
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(want, rel=1e-6)  # TB stores float32
    assert [e.value for e in events.Scalars("train/lr")] == pytest.approx([r["lr"] for r in records], rel=1e-6)
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["loss"]) for r in rows] == want and all(float(r["grad_norm"]) > 0 for r in rows)
    if "wandb" in OPTIONAL:
        assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    if "mlflow" in OPTIONAL:
        import os

        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
        [run] = client.search_runs([client.get_experiment_by_name("dtk").experiment_id])
        history = sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)
        assert [m.value for m in history] == pytest.approx(want)
    missing = sorted({"wandb", "mlflow"} - set(OPTIONAL))
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (optional extras; CI installs .[dev,hf]): checked the rest")


def test_export_refuses_bad_input_with_one_line(runs, tmp_path):
    from dtk import recipe

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    gpt = tmp_path / "gpt-run"  # the folder a built-in gpt run leaves, as far as these checks read it
    (gpt / "final").mkdir(parents=True)
    (gpt / "recipe.yaml").write_text(recipe.dump(recipe.build({})))
    (gpt / "final" / "model.safetensors").write_bytes(b"")
    cases = [
        (["export", tmp_path, "--out", tmp_path / "o1"], ["RUN_DIR: got", "no dtk run folder"]),
        (["export", runs["hf"], "--step", "3", "--out", tmp_path / "o2"], ["--step: got 3", "accepted: 4"]),
        (["export", gpt, "--format", "hf", "--out", tmp_path / "o3"], ["--format: got 'hf'", "model.hf"]),
        (["export", runs["hf"], "--format", "onnx", "--out", tmp_path / "o4"], ["--format: got 'onnx'"]),
        (["export", runs["hf"], "--out", tmp_path / "full"], ["--out: got", "not an empty folder"]),
        (["train", RECIPES / "quickstart.yaml", "optimizer.schedule=step", f"output.dir={tmp_path}/t1"],
         ["optimizer.schedule: got 'step'"]),
        (["train", RECIPES / "quickstart.yaml", "optimizer.min_lr=1", f"output.dir={tmp_path}/t2"],
         ["optimizer.min_lr: got 1"]),
    ]
    for args, mentions in cases:
        lines = assert_user_error(run_dtk(*args), mentions)
        assert len(lines) == 1, lines
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5))
    assert not (tmp_path / "t1").exists() and not (tmp_path / "t2").exists()


def test_a_logger_whose_package_is_missing_is_one_line_before_any_rank(tmp_path):
    """mlflow hidden the documented way (a None entry in sys.modules makes its import fail)."""
    code = "import sys; sys.modules['mlflow'] = None; from dtk.cli import main; main()"
    p = subprocess.run([sys.executable, "-c", code, "train", str(RECIPES / "quickstart.yaml"),
                        "output.loggers=[jsonl,mlflow]", f"output.dir={tmp_path}/run", "--no-progress"],
                       capture_output=True, text=True, timeout=120, env=dtk_env(), cwd=ROOT)
    lines = assert_user_error(p, ["output.loggers: 'mlflow' needs the mlflow package", 'pip install -e ".[mlflow]"'])
    assert len(lines) == 1 and not (tmp_path / "run").exists()
