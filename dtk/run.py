"""A rank's entry when torchrun, srun or a Kubeflow PyTorchJob starts the ranks: `torchrun --nproc-per-node N -m
dtk.run RECIPE [a.b=c ...]`. Modes none and checkpoint: torchelastic restarts the workers, each restart is a new
attempt on its own store prefix and resumes from the latest checkpoint; `inplace` needs dtk's own launcher."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from dtk import recipe as recipes
from dtk.errors import USER_ERROR_EXIT, DtkError
from dtk.rundir import prepare_run_dir

USAGE = "torchrun --nproc-per-node N -m dtk.run RECIPE [a.b=c ...]"


def rank_env(argv: list[str], environ: dict[str, str]) -> dict[str, str]:
    """What dtk.worker needs, from the recipe and torchrun's variables; the run folder is made (recipe.yaml in it).
    The store is torchrun's own (MASTER_ADDR:MASTER_PORT, hosted by its agent), so no rank hosts one."""
    if not argv:
        raise DtkError(f"RECIPE: missing; usage: {USAGE}")
    missing = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in environ]
    if missing:
        raise DtkError(f"environment: {', '.join(missing)} not set; dtk.run is started by torchrun (or srun, a "
                       f"PyTorchJob, through torchrun): {USAGE}; `dtk train RECIPE` starts the ranks itself")
    recipe = recipes.load(argv[0], argv[1:])
    if recipe.resilience.mode == "inplace":
        raise DtkError("resilience.mode: got 'inplace'; under torchrun accepted: none, checkpoint (in place needs "
                       "dtk's launcher on each node, for its shadows and the in-place regroup: start `dtk train` "
                       "there instead, as the node's one process)")
    nproc = int(environ["LOCAL_WORLD_SIZE"])
    if recipe.world.nproc != nproc:
        recipe.world.nproc = nproc  # torchrun's --nproc-per-node decides; recipe.yaml says what ran
    if not recipe.output.dir:
        # the same folder for every rank and every restart (a timestamp would differ): a restart resumes there
        recipe.output.dir = str(Path("runs") / Path(argv[0]).stem)
    run_dir = prepare_run_dir(recipe, argv[0])
    env = {"DTK_RUN_DIR": str(run_dir), "DTK_STORE": f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}",
           "DTK_ATTEMPT": environ.get("TORCHELASTIC_RESTART_COUNT", "0")}
    if recipe.world.device != "cuda":
        env["DS_ACCELERATOR"] = "cpu"
    return env


def main() -> None:
    try:
        env = rank_env(sys.argv[1:], dict(os.environ))
    except DtkError as e:
        for line in e.lines:
            print(f"error: {line}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR_EXIT)
    os.environ.update(env)
    from dtk import worker

    worker.main()


if __name__ == "__main__":
    main()
