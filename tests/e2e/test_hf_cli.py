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
