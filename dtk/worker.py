"""What one rank runs: connect to the run's store, create the seam as the default group, build data, model and
engine, then hand over to the trainer. Started by dtk.launch as `python -m dtk.worker` with RANK, WORLD_SIZE,
LOCAL_RANK, DTK_RUN_DIR and DTK_STORE in its environment; DTK_JOIN_GENERATION for a cold replacement rank, and
DTK_SHADOW (no rank yet) for a shadow, which builds everything it can, then waits to be promoted."""
from __future__ import annotations

import time

STARTED_AT = time.time()  # before the heavy imports: the launcher's "process start" vs "import" split

import dataclasses
import datetime
import logging
import os
import resource
import signal
import sys
import threading
import traceback
from pathlib import Path

from dtk import recipe as recipes
from dtk.errors import RUN_FAILED_EXIT, USER_ERROR_EXIT, DtkError

LOG_FORMAT = "%(asctime)s [{who}] %(levelname)s %(name)s: %(message)s"


def _setup_logging(who: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=LOG_FORMAT.format(who=who), force=True)


def _device(recipe, local_rank: int):
    import torch

    want = recipe.world.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise DtkError("world.device: got 'cuda'; no CUDA device is visible; accepted here: auto, cpu")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _watch_sigterm() -> None:
    """The launcher starts a rank with SIGTERM blocked, so that only this thread takes it, knowing who sent it. From
    the launcher (it stops the run): die of it at once, even while the main thread is blocked in a collective. From
    anyone else (Slurm signals every process of a job step; a user's kill): pass it to the launcher, which stops
    the whole run at one step boundary and saves it (checkpoint.every), instead of this rank dying alone."""
    if signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, []):
        return  # not started by dtk's launcher (torchrun, srun as ranks): SIGTERM keeps its default
    launcher = os.getppid()

    def watch() -> None:
        while True:
            sender = signal.sigwaitinfo({signal.SIGTERM}).si_pid
            if sender == launcher or os.getppid() != launcher:
                # signal.signal() works only in the main thread, which may be blocked in a collective: this
                # thread unblocks SIGTERM for itself and sends it to itself, so its default action ends the process
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
                signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
                os._exit(128 + signal.SIGTERM)  # reached only where a library installed a SIGTERM handler of its own
            logging.getLogger(__name__).warning("SIGTERM from pid %d: passed to the launcher (pid %d), which stops "
                                                "the run at a step boundary", sender, launcher)
            os.kill(launcher, signal.SIGTERM)

    threading.Thread(target=watch, name="dtk-sigterm", daemon=True).start()


def _become_rank(run_dir: str, rank: int) -> None:
    """A promoted shadow writes from now on where the rank it replaces wrote: logs/rank<N>.log."""
    from dtk.prestart import write_to

    write_to(str(Path(run_dir) / "logs" / f"rank{rank}.log"))
    _setup_logging(f"rank {rank}")


def _rehearse(recipe, ctx, group, *, model, rank: int, warm) -> None:
    """A sharded engine depends on its rank, so a shadow cannot build the one it will run before it is promoted.
    It builds one for a rank it may take, on its local group, and throws it away: the first build of a process
    pays for lazy imports, DeepSpeed's config and op set-up and the allocator's first pages (2.3 s for a tiny
    ZeRO model here); a second one, for the real rank at promotion, takes milliseconds. ZeRO-3 too: each build
    numbers its modules from 0 (dtk.strategies.zero)."""
    import copy
    import gc

    from dtk.comm.group import Seam
    from dtk.strategies import BuildContext, build_engine

    model = copy.deepcopy(model)  # the engine changes the model it wraps; the pristine one is kept for the real build
    t0 = time.time()
    Seam.assume_rank(rank, world=group.size())
    with Seam.uncounted():
        engine = build_engine(recipe.strategy.name, BuildContext(model_factory=lambda: model, recipe=recipe,
                                                                 group=group, device=ctx.device,
                                                                 blueprint=ctx.blueprint))
        engine.match_running_layout(*warm)
        # and runs a forward and backward (on the local group its collectives complete at once): the process's
        # first pass pays for autograd's and the kernels' lazy set-up, which the promoted engine's first step would
        engine.forward_backward(*warm, last_micro=True)
        engine.discard_step()
        engine.local_state()  # and the optimizer's state, made by a dry step: its first step's lazy set-up
    del engine, model
    gc.collect()
    # and moves everything alive now (torch's, DeepSpeed's, the rehearsal's caches) out of the collector's sight:
    # the real build at promotion runs full collections (ZeRO-3's parameter defragmentation calls gc.collect), and
    # a full collection over every object imports made cost 0.18 s on the recovery's critical path
    gc.freeze()
    # DTensor caches sharding propagation keyed by the mesh, and a mesh compares equal to the rehearsal's whatever
    # this process's coordinate in it: without this, the real engine's optimizer states (made by DTensor ops) kept
    # the rehearsal rank's offsets, and the first checkpoint after the promotion failed DCP's global plan check
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    logging.getLogger(__name__).info("rehearsed a %s engine for rank %d in %.2fs", recipe.strategy.name, rank,
                                     time.time() - t0)


def _build_context(recipe, spec, *, group, device):
    """The strategy's BuildContext, and the whole model when the strategy holds one (built before a shadow knows
    its rank: the model is the same for every rank). Sharded strategies get the blueprint instead and never hold
    the whole model (dtk.models.init)."""
    from dtk.models import build_model, model_blueprint
    from dtk.strategies import META_INIT, BuildContext

    seed = recipe.training.seed
    blueprint = model_blueprint(recipe.model, spec, seed=seed) if recipe.strategy.name in META_INIT else None
    prebuilt = [] if blueprint is not None else [build_model(recipe.model, spec, seed=seed)]

    def model_factory():
        return prebuilt.pop() if prebuilt else build_model(recipe.model, spec, seed=seed)

    ctx = BuildContext(model_factory=model_factory, recipe=recipe, group=group, device=device, blueprint=blueprint)
    return ctx, prebuilt


def _parameter_count(recipe, spec, ctx) -> int:
    """The model's parameters (the whole model's, not this rank's shard), counted on a meta build."""
    from dtk.models import model_blueprint

    blueprint = ctx.blueprint or model_blueprint(recipe.model, spec, seed=recipe.training.seed)
    if blueprint is None:
        from dtk.models import build_model

        return sum(p.numel() for p in build_model(recipe.model, spec, seed=recipe.training.seed).parameters())
    return sum(p.numel() for p in blueprint.meta().parameters())


def run_rank() -> None:
    shadow_id = os.environ.get("DTK_SHADOW")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    run_dir = os.environ["DTK_RUN_DIR"]
    join = os.environ.get("DTK_JOIN_GENERATION")
    attempt = int(os.environ.get("DTK_ATTEMPT", "0"))
    _setup_logging(f"shadow {shadow_id}" if shadow_id is not None else f"rank {rank}")
    _watch_sigterm()
    recipe = recipes.load(Path(run_dir) / "recipe.yaml")

    import torch
    import torch.distributed as dist

    from dtk.comm.group import Seam, register
    from dtk.data import build_dataset
    from dtk.metrics import append_event
    from dtk.resilience import checkpoint, inplace, shadow
    from dtk.resilience import protocol as keys
    from dtk.resilience.control import Control, connect
    from dtk.resilience.faults import Fault, Injector
    from dtk.strategies import RANK_AGNOSTIC, REHEARSABLE, build_engine
    from dtk.strategies.memory import BuildMemory
    from dtk.trainer import Trainer

    if shadow_id is not None and recipe.strategy.name.startswith("zero"):
        import deepspeed  # noqa: F401  (seconds of import a promoted shadow must not pay)
    timeline = {"spawned_at": float(os.environ.get("DTK_SPAWNED_AT", STARTED_AT)), "main_at": STARTED_AT,
                "imported_at": time.time()}

    torch.set_num_threads(recipe.world.threads_per_rank)
    device = _device(recipe, local_rank)
    use_nccl = device.type == "cuda" and recipe.world.backend != "gloo"
    register(use_nccl=use_nccl, comm_mode=recipe.comm.mode)
    Seam.joining = join is not None or shadow_id is not None
    Seam.generation = int(join or 0)
    store = connect(os.environ["DTK_STORE"])
    # every attempt rendezvouses on its own prefix: a restarted rank must not read a dead attempt's addresses
    dist.init_process_group("dtk", store=dist.PrefixStore(keys.world_prefix(attempt), store), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=recipe.world.timeout_s))
    group = dist.group.WORLD
    assert group is not None  # init_process_group made it
    timeline["group_at"] = time.time()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    build_memory = BuildMemory.start(device)
    dataset = build_dataset(recipe.data, seed=recipe.training.seed, world=world,
                            grad_accum=recipe.training.grad_accum)
    ctx, prebuilt = _build_context(recipe, dataset.spec, group=group, device=device)
    replacement = join is not None or shadow_id is not None
    if replacement and ctx.blueprint is not None and recipe.resilience.mode == "inplace":
        # a replacement in place: its state is rebuilt from parity before its first step, so its build draws no
        # values (Blueprint.blank; 0.1 s of a promoted ZeRO-3 shadow's build, which the survivors wait for), and a
        # shadow's rehearsal builds the same way, so that it warms the same code
        ctx = dataclasses.replace(ctx, blueprint=dataclasses.replace(ctx.blueprint, blank=True))
    engine = None
    warm = None
    if replacement:
        x, y = dataset.batch(step=0, rank=rank, micro=0, size=recipe.training.micro_batch)
        warm = (x.to(device), y.to(device))
    if shadow_id is not None:
        if recipe.strategy.name in RANK_AGNOSTIC:
            # Built and warmed while the others train: the group is local until the rejoin, so the engine's own
            # start-up collectives (DDP's broadcast, its bucket rebuild) stay on this process.
            engine = build_engine(recipe.strategy.name, ctx)
            assert warm is not None  # made above for every shadow
            with Seam.uncounted():
                engine.match_running_layout(*warm)
        elif recipe.strategy.name in REHEARSABLE:
            _rehearse(recipe, ctx, group, model=prebuilt[0] if prebuilt else None, rank=rank, warm=warm)
        promotion = shadow.wait_for_promotion(store, attempt=attempt, shadow_id=shadow_id, ready={
            "pid": os.getpid(), "engine_built": engine is not None, "ready_at": time.time(),
            "rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
        rank, join = promotion["rank"], str(promotion["generation"])
        timeline["promoted_at"] = time.time()
        _become_rank(run_dir, rank)
        Seam.assume_rank(rank, world=world)
        logging.getLogger(__name__).warning("shadow %s promoted to rank %d for generation %s", shadow_id, rank, join)
    if engine is None:
        engine = build_engine(recipe.strategy.name, ctx)
        if warm is not None:
            with Seam.uncounted():
                engine.match_running_layout(*warm)
    parity = None
    if recipe.resilience.mode == "inplace" and recipe.strategy.name not in RANK_AGNOSTIC:
        # sharded state is rebuilt from erasure parity; every rank (a replacement too) makes the same groups
        from dtk.resilience.parity import build_keeper

        # only what no peer can make again: an engine may leave its replicated state out and rebuild it
        parity = build_keeper(state=getattr(engine, "protected_state", engine.local_state),
                              rebuild=getattr(engine, "rebuild_replicated", None), local_state=engine.local_state,
                              resilience=recipe.resilience, nproc_per_node=recipe.world.nproc)
    if join is not None:
        # A fresh engine makes its optimizer state on first use (FSDP2's by DTensor ops, whose caches the rehearsal
        # cleared: 0.1 s for the 3.2M GPT on 2 cores). Made here, it overlaps the survivors' finishing their
        # interrupted step; made by the rebuild's first call, every rank waited for it.
        engine.local_state()
    timeline["engine_at"] = time.time()
    if rank == 0:  # summary.json -> parameters
        append_event(run_dir, {"event": "model", "parameters": _parameter_count(recipe, dataset.spec, ctx)})
    control = Control(address=os.environ["DTK_STORE"], rank=rank, attempt=attempt)
    injector = Injector(rank=rank, store=control.run_store, engine=engine)
    for spec in control.initial_faults():
        injector.add(Fault(**spec))
    control.on_faults = lambda specs: _add_faults(injector, specs)
    control.start()
    trainer = Trainer(recipe=recipe, engine=engine, dataset=dataset, group=group, control=control,
                      device=device, base_rss=base_rss, run_dir=run_dir, injector=injector, parity=parity,
                      build_memory=build_memory)

    start = 0
    if join is not None:
        control.phase = "recovery"
        start = inplace.rejoin_as_replacement(engine=engine, control=control, group=group, generation=int(join),
                                              device=device, ready_at=timeline.get("promoted_at", time.time()),
                                              on_repair=lambda step: injector.at(step, "recovery"), parity=parity)
        control.phase = "train"
    elif (recipe.checkpoint.resume == "auto" or attempt > 0) and (found := checkpoint.latest(run_dir)):
        start = checkpoint.load(engine, found[1])
        logging.getLogger(__name__).info("resumed from %s at step %d", found[1], start)
        x, y = dataset.batch(step=start, rank=rank, micro=0, size=recipe.training.micro_batch)
        engine.match_running_layout(x.to(device), y.to(device))  # every rank restarts: collectives match
    trainer.resume_records(start)  # records past the start are from a run that did not keep them
    timeline.update(loaded_at=time.time(), start_step=start)
    control.mark(keys.started(rank), timeline)
    trainer.run(start_step=start)
    control.close()
    dist.destroy_process_group()


def _add_faults(injector, specs: list[dict]) -> None:
    """Faults announced while the rank runs (`dtk inject-failure --run`), from the control thread."""
    from dtk.resilience.faults import Fault

    for f in specs:
        injector.add(Fault(**f))


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


def prestarted(deepspeed: bool) -> None:
    """`python -m dtk.worker --prestarted [deepspeed]` (dtk.prestart): the imports of a rank's start, then the rank
    the launcher hands over on stdin. An import that fails is raised once the rank's log is known, so that its
    traceback is in that log, where a rank started the usual way would have written it."""
    from dtk.prestart import become

    failed = None
    try:
        import torch  # noqa: F401
        import torch._dynamo  # noqa: F401  (DDP's constructor imports it: 1.2 s)
        import torch.distributed  # noqa: F401

        import dtk.strategies  # noqa: F401
        import dtk.trainer  # noqa: F401

        if deepspeed:
            import deepspeed as _  # noqa: F401
    except Exception as e:  # noqa: BLE001  (raised below, in the rank's log)
        failed = e

    order = sys.stdin.readline()
    if not order:
        os._exit(0)  # the launcher ended before it started the ranks
    become(order)
    if failed is not None:
        raise failed
    main()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--prestarted"]:
        prestarted(deepspeed=sys.argv[2:] == ["deepspeed"])
    else:
        main()
