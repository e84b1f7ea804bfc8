"""What one rank runs: connect to the run's store, create the seam as the default group, build data, model and
engine, then hand over to the trainer. Started by dtk.launch as `python -m dtk.worker` with RANK, WORLD_SIZE,
LOCAL_RANK, DTK_RUN_DIR and DTK_STORE in its environment (DTK_JOIN_GENERATION for a replacement rank)."""
from __future__ import annotations

import time

STARTED_AT = time.time()  # before the heavy imports: the launcher's "process start" vs "import" split

import datetime
import logging
import os
import resource
import sys
import traceback
from pathlib import Path

from dtk import recipe as recipes
from dtk.errors import RUN_FAILED_EXIT, USER_ERROR_EXIT, DtkError


def _setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")


def _device(recipe, local_rank: int):
    import torch

    want = recipe.world.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise DtkError("world.device: got 'cuda'; no CUDA device is visible; accepted here: auto, cpu")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_rank() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    run_dir = os.environ["DTK_RUN_DIR"]
    join = os.environ.get("DTK_JOIN_GENERATION")
    attempt = int(os.environ.get("DTK_ATTEMPT", "0"))
    _setup_logging(rank)
    recipe = recipes.load(Path(run_dir) / "recipe.yaml")

    import torch
    import torch.distributed as dist

    from dtk.comm.group import Seam, register
    from dtk.data import build_dataset
    from dtk.models import build_model
    from dtk.resilience import checkpoint, inplace
    from dtk.resilience.control import Control, connect
    from dtk.resilience.faults import Fault, Injector
    from dtk.strategies import BuildContext, build_engine
    from dtk.trainer import Trainer

    timeline = {"spawned_at": float(os.environ.get("DTK_SPAWNED_AT", STARTED_AT)), "main_at": STARTED_AT,
                "imported_at": time.time()}

    torch.set_num_threads(recipe.world.threads_per_rank)
    device = _device(recipe, local_rank)
    use_nccl = device.type == "cuda" and recipe.world.backend != "gloo"
    register(use_nccl=use_nccl, comm_mode=recipe.comm.mode)
    Seam.joining = join is not None
    Seam.generation = int(join or 0)
    control = Control(address=os.environ["DTK_STORE"], rank=rank, attempt=attempt)
    # every attempt rendezvouses on its own prefix: a restarted rank must not read a dead attempt's addresses
    dist.init_process_group("dtk", store=dist.PrefixStore(f"a{attempt}/world", connect(os.environ["DTK_STORE"])),
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=recipe.world.timeout_s))
    group = dist.group.WORLD
    timeline["group_at"] = time.time()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    dataset = build_dataset(recipe.data, seed=recipe.training.seed)
    ctx = BuildContext(model_factory=lambda: build_model(recipe.model, dataset.spec, seed=recipe.training.seed),
                       recipe=recipe, group=group, device=device)
    engine = build_engine(recipe.strategy.name, ctx)
    timeline["engine_at"] = time.time()
    injector = Injector(rank=rank, store=control.run_store, engine=engine)
    for spec in control.initial_faults():
        injector.add(Fault(**spec))
    control.on_faults = lambda specs: [injector.add(Fault(**f)) for f in specs]
    control.start()
    trainer = Trainer(recipe=recipe, engine=engine, dataset=dataset, group=group, control=control,
                      device=device, base_rss=base_rss, run_dir=run_dir, injector=injector)

    start = 0
    if join is not None:
        # Built while the others train on: the group is local until the rejoin, so the engine's own start-up
        # collectives (DDP's broadcast, its bucket rebuild on the second step) stay on this process.
        x, y = dataset.batch(step=0, rank=rank, micro=0, size=recipe.training.micro_batch)
        with Seam.uncounted():
            for _ in range(2):
                engine.forward_backward(x.to(device), y.to(device), last_micro=True)
            engine.discard_step()
        start, timings = inplace.rejoin(engine=engine, control=control, group=group, generation=int(join), device=device)
        control.report(int(join), "rejoined", {"engine_id": id(engine), "replacement": True, **timings})
        logging.getLogger(__name__).warning("joined generation %s at step %d: %s", join, start, timings)
    elif (recipe.checkpoint.resume == "auto" or attempt > 0) and (found := checkpoint.latest(run_dir)):
        start = checkpoint.load(engine, found[1])
        logging.getLogger(__name__).info("resumed from %s at step %d", found[1], start)
    if trainer.writer and join is None:
        trainer.writer.truncate_from(start)  # records past the start are from a run that did not keep them
    timeline.update(loaded_at=time.time(), start_step=start)
    control.mark("started", timeline)
    trainer.run(start_step=start)
    control.close()
    dist.destroy_process_group()


def main() -> None:
    try:
        run_rank()
    except DtkError as e:
        for line in e.lines:
            print(f"error: {line}", file=sys.stderr, flush=True)
        os._exit(USER_ERROR_EXIT)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(RUN_FAILED_EXIT)
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without running interpreter teardown: DeepSpeed/ZeRO-3 sometimes aborts there after a finished run.
    os._exit(0)


if __name__ == "__main__":
    main()
