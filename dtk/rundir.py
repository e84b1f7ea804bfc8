"""A run's folder: where it goes (output.dir, else runs/<recipe>-<time>), the recipe it ran, and the last lines of
a log for an error message."""
from __future__ import annotations

import os
import time
from pathlib import Path

from dtk import recipe as recipes
from dtk.errors import DtkError


def default_run_dir(recipe_path: str | None) -> Path:
    stem = Path(recipe_path).stem if recipe_path else "run"
    return Path("runs") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def prepare_run_dir(recipe: recipes.Recipe, recipe_path: str | None) -> Path:
    run_dir = Path(recipe.output.dir) if recipe.output.dir else default_run_dir(recipe_path)
    try:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DtkError(f"output.dir: got {str(run_dir)!r}; cannot create it ({e.strerror})") from None
    recipe.output.dir = str(run_dir)
    # every node's launcher writes it (a run folder need not be shared), while ranks may be reading it: atomically
    tmp = run_dir / f".recipe.yaml.{os.getpid()}"
    tmp.write_text(recipes.dump(recipe))
    os.replace(tmp, run_dir / "recipe.yaml")
    return run_dir


def tail(path: Path, n: int = 12) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line for line in lines if line.strip()][-n:]
