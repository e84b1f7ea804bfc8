"""model.hf through the CLI as a user runs it: the shipped GPT-2 recipe trains block-sharded under FSDP and says
which units it sharded; a missing extra, an unknown model type or a folder without config.json is one line, exit 2."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import RECIPES, ROOT, dtk_env, losses, run_dtk
from test_cli_errors import assert_user_error

pytestmark = pytest.mark.e2e
HF_GPT2 = RECIPES / "hf-gpt2.yaml"


@pytest.mark.timeout(300)
def test_the_gpt2_recipe_trains_and_reports_its_fsdp_wrap_units(tmp_path):
    pytest.importorskip("transformers")
    run_dir = tmp_path / "run"
    p = run_dtk("train", HF_GPT2, "training.steps=30", f"output.dir={run_dir}", "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:] + (run_dir / "logs" / "rank0.log").read_text()[-3000:]
    values = losses(run_dir)
    assert len(values) == 30
    assert sum(values[-5:]) / 5 < 0.8 * sum(values[:5]) / 5, values
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["fsdp_wrap_units"] == {"count": 2, "classes": {"GPT2Block": 2}, "source": "_no_split_modules",
                                          "root": "GPT2LMHeadModel"}
    assert "fsdp wrap units: 2 x GPT2Block (from _no_split_modules)" in (run_dir / "logs" / "rank0.log").read_text()


def test_without_the_extra_the_error_names_it(tmp_path):
    """transformers hidden the documented way (a None entry in sys.modules makes its import fail)."""
    run_dir = tmp_path / "run"
    code = "import sys; sys.modules['transformers'] = None; from dtk.cli import main; main()"
    p = subprocess.run([sys.executable, "-c", code, "train", str(HF_GPT2), f"output.dir={run_dir}", "--no-progress"],
                       capture_output=True, text=True, timeout=120, env=dtk_env(), cwd=ROOT)
    lines = assert_user_error(p, ["model.hf", "transformers", 'pip install -e ".[hf]"'])
    assert len(lines) == 1, p.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("args, mentions", [
    (["model.hf.model_type=gpt3"], ["model.hf.model_type", "'gpt3'", "gpt2"]),
    (["model.hf.model_type=null", "model.hf.path=recipes/data"], ["model.hf.path", "'recipes/data'", "config.json"]),
], ids=["unknown_model_type", "path_without_config_json"])
def test_train_refuses_a_bad_hf_model_with_one_line(tmp_path, args, mentions):
    pytest.importorskip("transformers")
    run_dir = tmp_path / "run"
    p = run_dtk("train", HF_GPT2, f"output.dir={run_dir}", *args, "--no-progress", timeout=120)
    lines = assert_user_error(p, mentions)
    assert len(lines) == 1, p.stderr
    assert not run_dir.exists(), "a refused run must not write its run folder"


@pytest.mark.timeout(300)
def test_the_readmes_folder_command_trains_and_a_config_that_misfits_the_weights_is_one_line(tmp_path):
    """README's `model.hf.path=path/to/folder` line, on a folder save_pretrained wrote (GPT-2, 1 layer of 32): as
    written it trains; without its `model.hf.config={}` the recipe's n_layer 2 / n_embd 64 would not fit the weights
    (a rank's transformers traceback before): one line at validate, exit 2."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "folder"
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0,
                                     eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    readme = (ROOT / "README.md").read_text()
    [line] = [x for x in readme.splitlines() if x.startswith("dtk train recipes/hf-gpt2.yaml") and "path/to/folder" in x]
    args = line.split("#")[0].replace("path/to/folder", str(folder)).split()[2:]
    p = run_dtk("train", *args, "training.steps=2", "world.nproc=1", f"output.dir={tmp_path / 'run'}", "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(losses(tmp_path / "run")) == 2
    p = run_dtk("validate", *[a for a in args if a != "model.hf.config={}"], timeout=120)
    assert assert_user_error(p, ["model.hf.config.n_layer", "got 2", "saved with n_layer=1", "n_embd=64 (saved: 32)"])
