"""`dtk compare recipes/gcpsl.yaml --strategies gcpsl,gcpsl_serial` as a user runs it: the serial baseline runs
the same 4 clusters on one rank, and both variants carry accuracy, participation and time to target."""
from __future__ import annotations

import json

import pytest
import yaml

from conftest import RECIPES, run_dtk

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(600)
def test_compare_gcpsl_with_its_serial_baseline(tmp_path):
    out = tmp_path / "cmp"
    p = run_dtk("compare", RECIPES / "gcpsl.yaml", "training.steps=10", "training.target_accuracy=0.15",
                "--strategies", "gcpsl,gcpsl_serial", "--out", out, "--no-progress", timeout=540)
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    doc = json.loads((out / "compare.json").read_text())
    par, ser = doc["variants"]
    assert (par["variant"], ser["variant"]) == ("gcpsl", "gcpsl_serial")
    assert (par["world_size"], ser["world_size"]) == (4, 1)
    serial_recipe = yaml.safe_load((out / "gcpsl_serial" / "recipe.yaml").read_text())
    assert serial_recipe["strategy"]["clusters"] == 4 and serial_recipe["world"]["nproc"] == 1
    for v in (par, ser):
        assert v["status"] == "completed"
        assert 0 < v["accuracy"] <= 1 and 0 < v["participation"] <= 1
        assert v["time_to_target_s"] > 0 and v["target_accuracy"] == 0.15
    assert ser["max_rel_loss_diff"] < 1e-4  # the same workloads: only the order of the merge's sum differs
    assert par["comm_by_kind"]["all_reduce"]["bytes_per_step"] > 0 and ser["comm_bytes_per_step"] == 0
    assert "first_to_target" in doc["verdict"]
    text = " ".join(p.stdout.split())
    assert "first to target" in text and "held-out" in text
    md = (out / "compare.md").read_text()
    assert "s to target" in md and "2Ψ/5" in md and "4×16Ψ" in md
