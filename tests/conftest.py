"""Shared helpers: run the real `dtk` CLI in a subprocess on tiny recipes, read what it wrote."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"

# A tiny GPT: 2 ranks on 2 cores train a step in a few tens of milliseconds.
TINY = ["model.layers=1", "model.width=32", "model.heads=2", "data.seq_len=16", "data.vocab_size=32",
        "training.micro_batch=4", "world.nproc=2"]


def dtk_env() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    return env


def run_dtk(*args: str, timeout: float = 240, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`dtk ARGS...` as a user runs it; returns the finished process (stdout/stderr as text)."""
    return subprocess.run([sys.executable, "-m", "dtk.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=dtk_env(), cwd=cwd or ROOT)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "loss" in r]


def train(run_dir: Path, *overrides: str, recipe: Path = RECIPES / "quickstart.yaml", timeout: float = 240) -> Path:
    """Train `recipe` + TINY + overrides into run_dir; fails the test with the rank logs if the run fails."""
    p = run_dtk("train", recipe, *TINY, f"output.dir={run_dir}", *overrides, "--no-progress", timeout=timeout)
    if p.returncode != 0:
        logs = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted((Path(run_dir) / "logs").glob("*.log")))
        pytest.fail(f"dtk train exited {p.returncode}\nstdout:{p.stdout}\nstderr:{p.stderr[-3000:]}\n{logs}")
    return Path(run_dir)


@pytest.fixture(scope="session")
def reference_losses(tmp_path_factory):
    """`reference_losses(*overrides)`: the losses of `train(*overrides)`, a run without faults, made once per set of
    overrides in the session and shared by every test that compares against it."""
    root = tmp_path_factory.mktemp("references")
    cache: dict[tuple[str, ...], list[float]] = {}

    def get(*overrides: str) -> list[float]:
        if overrides not in cache:
            cache[overrides] = losses(train(root / str(len(cache)), *overrides))
        return cache[overrides]
    return get
