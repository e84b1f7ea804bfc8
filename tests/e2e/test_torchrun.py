"""torchrun starts dtk's ranks (`torchrun -m dtk.run RECIPE`): the same losses and run folder as `dtk train`, on
torchrun's own store; an in-place recipe or a missing torchrun environment is refused in one line."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import RECIPES, ROOT, TINY, dtk_env, losses
from dtk.errors import DtkError
from dtk.run import rank_env

TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500"}


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_torchrun_trains_the_recipe_as_dtk_train_does(tmp_path, reference_losses):
    overrides = ["training.steps=8", "checkpoint.every=4", "resilience.mode=checkpoint"]
    run_dir = tmp_path / "torchrun"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "--max-restarts", "1", "-m", "dtk.run", str(RECIPES / "quickstart.yaml"), *TINY, *overrides,
                        f"output.dir={run_dir}"], capture_output=True, text=True, timeout=180, env=dtk_env(), cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert losses(run_dir) == reference_losses(*overrides)
    assert (run_dir / "recipe.yaml").exists()
    assert sorted(x.name for x in (run_dir / "checkpoints").iterdir())[-1] == "step_8"


def test_in_place_and_a_missing_torchrun_environment_are_refused_in_one_line(tmp_path):
    recipe = str(RECIPES / "quickstart.yaml")
    with pytest.raises(DtkError) as e:
        rank_env([recipe, "resilience.mode=inplace", f"output.dir={tmp_path}"], TORCHRUN_ENV)
    assert e.value.lines[0].startswith("resilience.mode: got 'inplace'; under torchrun accepted: none, checkpoint")
    with pytest.raises(DtkError) as e:
        rank_env([recipe], {})
    assert e.value.lines[0].startswith("environment: RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT "
                                       "not set")
    env = rank_env([recipe, "world.nproc=4", f"output.dir={tmp_path}"], {**TORCHRUN_ENV,
                                                                           "TORCHELASTIC_RESTART_COUNT": "1"})
    assert env["DTK_STORE"] == "127.0.0.1:29500" and env["DTK_ATTEMPT"] == "1"  # a restart rendezvouses afresh
    assert "nproc: 2" in (tmp_path / "recipe.yaml").read_text()  # torchrun's --nproc-per-node decides
