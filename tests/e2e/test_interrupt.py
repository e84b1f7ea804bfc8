"""Ctrl-C or SIGTERM during `dtk train`, a disk that fills, and a recipe that is not text: what a person sees (one
line each, no traceback)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import RECIPES, ROOT, TINY, dtk_env, read_jsonl, run_dtk

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig, every", [(signal.SIGINT, 0), (signal.SIGTERM, 3)], ids=["ctrl-c", "sigterm"])
def test_an_interrupt_says_where_the_run_stands(tmp_path, sig, every):
    """Ctrl-C reaches the launcher and every rank (a terminal's foreground group); so does SIGTERM from Slurm
    (every process of the job step). SIGTERM with checkpoints on: every rank finishes its step and saves it."""
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
        for pid in [proc.pid, *ranks.values()]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, out + err
    steps = len([r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r])
    by = " (SIGTERM)" if sig == signal.SIGTERM else ""
    assert f"interrupted{by} at step {steps}" in out and "failed" not in out
    assert ("resumable from the checkpoint" in out) == bool(every)
    assert ("not resumable" in out) == (not every)
    assert "Traceback" not in out + err
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    if sig == signal.SIGTERM:  # nothing lost: the step it stopped at was saved, and the run resumes from it
        assert f"resumable from the checkpoint of step {steps}:" in out
        p = run_dtk("train", RECIPES / "quickstart.yaml", *TINY, f"training.steps={steps + 2}",
                    f"checkpoint.every={every}", f"output.dir={run_dir}", "--no-progress")
        assert p.returncode == 0, p.stderr
        assert f"at step {steps}" in (run_dir / "logs" / "rank0.log").read_text()
        assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r] == list(range(steps + 2))


def test_a_recipe_that_is_not_text_is_one_line(tmp_path):
    bad = tmp_path / "photo.yaml"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    p = run_dtk("train", bad, f"output.dir={tmp_path / 'run'}")
    assert p.returncode == 2 and p.stderr.startswith("error: recipe:") and "not UTF-8 text" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


@pytest.mark.timeout(120)
def test_a_full_disk_is_one_line_and_the_folder_moved_to_a_larger_one_resumes(tmp_path):
    """The run folder on a 6 MB file system (the quickstart model's checkpoints are ~5 MB each): it fills at the second
    checkpoint. One line says which folder, that the disk is full and which checkpoint is whole."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(small)], check=True)
    try:
        args = [RECIPES / "quickstart.yaml", "training.steps=30", "checkpoint.every=5", "--no-progress"]
        p = run_dtk("train", *args, f"output.dir={small / 'run'}", timeout=90)
        shutil.copytree(small / "run", tmp_path / "big")
    finally:
        subprocess.run(["umount", str(small)], check=True)
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stderr.strip() == (f"error: output.dir: the disk holding {small / 'run'} is full (No space left on "
                                f"device); the run is stopped; the checkpoint of step 5 "
                                f"({small / 'run' / 'checkpoints' / 'step_5'}) is whole: free some space, or move the "
                                f"folder to a larger disk, and run the same command with output.dir=<the folder> to "
                                f"resume from it.")
    assert "Traceback" not in p.stdout
    assert not list((tmp_path / "big").glob(".summary.json.*")), "no half-written summary is left behind"
    again = run_dtk("train", *args[:1], "training.steps=7", *args[2:], f"output.dir={tmp_path / 'big'}", timeout=90)
    assert again.returncode == 0, again.stderr
    assert "the newer one cannot be trusted: step_10: it has no manifest.json" in again.stderr
    assert "at step 5" in (tmp_path / "big" / "logs" / "rank0.log").read_text()
    assert [r["step"] for r in read_jsonl(tmp_path / "big" / "metrics.jsonl") if "loss" in r] == list(range(7))
