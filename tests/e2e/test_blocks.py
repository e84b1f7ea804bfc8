"""Activation checkpointing and torch.compile of the blocks through `dtk train`, as a user runs them: one tiny run
with both (compile is slow to warm), against the run without; a recipe that compiles on a machine without a C++
compiler is one line and exit 2, before any rank starts."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import RECIPES, ROOT, TINY, dtk_env, losses, train

pytestmark = [pytest.mark.timeout(400)]


def test_compiled_and_checkpointed_blocks_train_as_eager_ones(reference_losses, tmp_path):
    eager = reference_losses("strategy.name=fsdp", "training.steps=3")
    run = train(tmp_path / "run", "strategy.name=fsdp", "training.steps=3", "training.compile=true",
                "training.activation_checkpointing=full", timeout=380)
    assert losses(run) == pytest.approx(eager, rel=1e-4, abs=0)


def test_compile_without_a_compiler_is_one_line_and_exit_2(tmp_path):
    env = dtk_env() | {"PATH": str(tmp_path)}  # an empty folder: no g++
    p = subprocess.run([sys.executable, "-m", "dtk.cli", "train", str(RECIPES / "quickstart.yaml"), *TINY,
                        "training.compile=true", f"output.dir={tmp_path / 'run'}", "--no-progress"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert p.returncode == 2, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines == ["error: training.compile: got true; torch.compile's inductor backend needs a C++ compiler and "
                     "g++ is not on PATH; accepted: install one (apt-get install g++, or name it in CXX) or "
                     "training.compile: false"], p.stderr
    assert not (tmp_path / "run" / "logs").exists()  # no rank started
