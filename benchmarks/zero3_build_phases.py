"""Where a ZeRO-3 rank's build memory goes: the resident-set growth of each rank after each phase of dtk's zero3
build (the model inside deepspeed.zero.Init, then DeepSpeed's optimizer set-up, step by step), against the whole
model's fp32 bytes. Two ranks on gloo, spawned here (no `dtk train`), so every phase can be timed from inside.

    python benchmarks/zero3_build_phases.py [--layers 24] [--width 1024] [strategy.bucket_mb=25 ...]
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) * 1024


def _probe(owner, name: str, label: str, rows: list, start: int) -> None:
    """Wrap owner.name: after each call, note (label, RSS growth now, peak growth so far) since `start`."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapped(*args, **kwargs):
        out = inner(*args, **kwargs)
        rows.append({"phase": label, "rss": _rss() - start, "peak": _hwm() - start})
        return out

    setattr(owner, name, wrapped)


def _rank_main(rank: int, world: int, port: int, overrides: list[str], results) -> None:
    os.environ.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from dtk import recipe
    from dtk.comm.group import register
    from dtk.data import build_dataset
    from dtk.models import build_model, model_blueprint
    from dtk.strategies import BuildContext, build_engine

    register()
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=600))
    dist.init_process_group("dtk", store=store, rank=rank, world_size=world)
    r = recipe.build({}, ["strategy.name=zero3", "data.seq_len=32", "training.micro_batch=1", *overrides])
    data = build_dataset(r.data, seed=0)
    blueprint = model_blueprint(r.model, data.spec, seed=0)
    ctx = BuildContext(model_factory=lambda: build_model(r.model, data.spec, seed=0), recipe=r,
                       group=dist.group.WORLD, device=torch.device("cpu"), blueprint=blueprint)
    import deepspeed
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    from dtk.strategies import zero

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the resident peak, as dtk's BuildMemory does
    start, rows = _rss(), []
    _probe(zero, "_model", "model built in zero.Init and filled", rows, start)
    _probe(Stage3, "_create_fp16_partitions_with_defragmentation", "working-copy partitions made flat", rows, start)
    _probe(Stage3, "_create_fp32_partitions", "fp32 master partitions", rows, start)
    _probe(Stage3, "initialize_optimizer_states", "initialize_optimizer_states (its gradient buffer)", rows, start)
    _probe(Stage3, "_setup_for_real_optimizer", "reduce bucket + gradient partitions", rows, start)
    _probe(deepspeed, "initialize", "deepspeed.initialize returned", rows, start)
    engine = build_engine("zero3", ctx)
    x, y = data.batch(step=0, rank=rank, micro=0, size=1)
    engine.forward_backward(x, y, last_micro=True)
    engine.optimizer_step()
    rows.append({"phase": "after the first step", "rss": _rss() - start, "peak": _hwm() - start})
    full = sum(p.numel() for p in blueprint.meta().parameters()) * 4
    results[rank] = {"rows": rows, "model_fp32_bytes": full}
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "zero3_build_phases.json"))
    p.add_argument("overrides", nargs="*", help="recipe overrides, e.g. strategy.bucket_mb=25")
    a = p.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch.multiprocessing as mp

    from dtk.rendezvous import free_port

    overrides = [f"model.layers={a.layers}", f"model.width={a.width}", "model.heads=16", *a.overrides]
    results = mp.Manager().dict()
    mp.start_processes(_rank_main, args=(2, free_port(), overrides, results), nprocs=2, start_method="spawn")
    full = results[0]["model_fp32_bytes"]
    print(f"model fp32: {full / 2**20:,.0f} MiB; overrides: {' '.join(a.overrides) or '(none)'}")
    print("| phase (zero3 build, in order) | RSS growth, rank 0 / 1 | ÷ model | peak so far ÷ model |")
    print("|---|---|---|---|")
    for row0, row1 in zip(results[0]["rows"], results[1]["rows"]):
        mib = f"{row0['rss'] / 2**20:,.0f} / {row1['rss'] / 2**20:,.0f} MiB"
        print(f"| {row0['phase']} | {mib} | {row0['rss'] / full:.2f} / {row1['rss'] / full:.2f} "
              f"| {row0['peak'] / full:.2f} / {row1['peak'] / full:.2f} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "ranks": dict(results)}, indent=2))


if __name__ == "__main__":
    main()
