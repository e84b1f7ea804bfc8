"""Ctrl-C during `dtk train` and a recipe that is not text: what a person sees (one line each, no traceback)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import RECIPES, ROOT, TINY, dtk_env, read_jsonl, run_dtk

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(300)
@pytest.mark.parametrize("every", [0, 3])
def test_ctrl_c_says_where_the_run_stands(tmp_path, every):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "dtk.cli", "train", str(RECIPES / "quickstart.yaml"), *TINY, "training.steps=100000",
           f"checkpoint.every={every}", f"output.dir={run_dir}", "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dtk_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            path = run_dir / "metrics.jsonl"
            if path.exists() and len(path.read_text().splitlines()) >= 5:
                break
            time.sleep(0.1)
        ranks = json.loads((run_dir / "ranks.json").read_text())["ranks"]
        # a terminal's Ctrl-C reaches the whole foreground group: the launcher and every rank
        for pid in [proc.pid, *ranks.values()]:
            try:
                os.kill(pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out + err
    steps = len([r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r])
    assert f"interrupted at step {steps}" in out and "failed" not in out
    assert ("resumable from the checkpoint" in out) == bool(every)
    assert ("not resumable" in out) == (not every)
    assert "Traceback" not in out + err
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"


def test_a_recipe_that_is_not_text_is_one_line(tmp_path):
    bad = tmp_path / "photo.yaml"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    p = run_dtk("train", bad, f"output.dir={tmp_path / 'run'}")
    assert p.returncode == 2 and p.stderr.startswith("error: recipe:") and "not UTF-8 text" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()
