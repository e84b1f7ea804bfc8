"""The shipped recipes and the registries' listings, through the CLI as a user runs it."""
from __future__ import annotations

import pytest

from conftest import RECIPES, losses, run_dtk

pytestmark = pytest.mark.e2e

SHIPPED = sorted(RECIPES.glob("*.yaml"))


def test_the_expected_recipes_ship():
    names = {p.name for p in SHIPPED}
    assert {"quickstart.yaml", "digits.yaml", "text.yaml"} <= names


@pytest.mark.parametrize("recipe", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_recipe_validates(recipe):
    p = run_dtk("validate", recipe, timeout=60)  # from the repository root, as the recipes say
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    assert f"ok: {recipe}" in " ".join(p.stdout.split())


@pytest.mark.parametrize("recipe", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_recipe_says_what_it_is_and_how_to_run_it(recipe):
    head = recipe.read_text().splitlines()[:3]
    assert all(line.startswith("#") for line in head), head
    assert any(f"dtk train recipes/{recipe.name}" in line for line in recipe.read_text().splitlines()[:5])


@pytest.mark.parametrize("command, entries", [
    ("strategies", ["ddp", "fsdp", "zero1", "zero2", "zero3"]),
    ("models", ["gpt", "mlp", "cnn"]),
    ("datasets", ["synthetic", "digits", "text"]),
])
def test_listing(command, entries):
    p = run_dtk(command, timeout=60)
    assert p.returncode == 0, p.stderr
    rows = [line for line in p.stdout.splitlines() if "│" in line or "|" in line]
    first_cells = {line.strip("│| ").split("│")[0].strip() for line in rows}
    for name in entries:
        assert name in first_cells, p.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recipe", ["digits.yaml", "text.yaml"])
def test_shipped_recipe_trains_and_its_loss_falls(tmp_path, recipe):
    run_dir = tmp_path / "run"
    p = run_dtk("train", RECIPES / recipe, "training.steps=30", f"output.dir={run_dir}", "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    values = losses(run_dir)
    assert len(values) == 30
    assert sum(values[-5:]) / 5 < 0.8 * sum(values[:5]) / 5, values
