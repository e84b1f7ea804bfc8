"""DeepSpeed ZeRO-1/2's gradient reduction, both ways, through dtk's engines on the seam: all-reduce of whole buckets
(`use_multi_rank_bucket_allreduce: true`, DeepSpeed's default) vs each partition reduced to its owner (false, what
dtk uses); steps/s (median step time after 3 warm-up) and the seam's bytes per step, alternating, in one spawn.

    python benchmarks/zero_reduce.py [--reps 3] [--steps 12]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "plain"))
import workload  # noqa: E402


def _rank(rank: int, world: int, port: int, results, reps: int, steps: int) -> None:
    os.environ.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    from dtk import recipe
    from dtk.comm.group import Seam, register
    from dtk.data import build_dataset
    from dtk.models import build_model
    from dtk.strategies import BuildContext, build_engine

    register()
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("dtk", store=store, rank=rank, world_size=world)
    initialize, out = deepspeed.initialize, {}
    m = workload.MODEL
    for rep in range(reps):
        for flag in ([True, False] if rep % 2 == 0 else [False, True]):
            def init(*a, config, _flag=flag, **k):
                config["zero_optimization"]["use_multi_rank_bucket_allreduce"] = _flag
                return initialize(*a, config=config, **k)

            deepspeed.initialize = init
            for name in ("zero1", "zero2"):
                r = recipe.build({}, [f"model.layers={m['layers']}", f"model.width={m['width']}",
                                      f"model.heads={m['heads']}", f"data.vocab_size={workload.VOCAB}",
                                      f"data.seq_len={workload.SEQ_LEN}", f"training.micro_batch={workload.MICRO_BATCH}",
                                      f"strategy.name={name}"])
                data = build_dataset(r.data, seed=0)
                ctx = BuildContext(model_factory=lambda: build_model(r.model, data.spec, seed=0), recipe=r,
                                   group=dist.group.WORLD, device=torch.device("cpu"))
                engine = build_engine(name, ctx)
                times = []
                for step in range(steps):
                    Seam.stats.take()
                    t0 = time.perf_counter()
                    x, y = data.batch(step=step, rank=rank, micro=0, size=workload.MICRO_BATCH)
                    engine.forward_backward(x, y, last_micro=True)
                    engine.optimizer_step()
                    times.append(time.perf_counter() - t0)
                    comm = Seam.stats.take()
                out.setdefault(f"{name} bucket_allreduce={flag}", []).append(
                    {"steps_per_s": 1 / statistics.median(times[3:]), "bytes_per_step": comm["bytes"],
                     "by_kind": {k: v["bytes"] for k, v in comm["by_kind"].items()}})
    results[rank] = out
    dist.destroy_process_group()


def main() -> None:
    from dtk.rendezvous import free_port

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "zero_reduce.json"))
    args = p.parse_args()
    results = mp.Manager().dict()
    mp.start_processes(_rank, args=(2, free_port(), results, args.reps, args.steps), nprocs=2, start_method="spawn")
    rows = dict(results[0])
    for name, reps in rows.items():
        speeds = [r["steps_per_s"] for r in reps]
        print(f"{name:32s} steps/s {statistics.median(speeds):.3f} ({', '.join(f'{v:.2f}' for v in speeds)})  "
              f"bytes/step {reps[-1]['bytes_per_step']:,.0f} {reps[-1]['by_kind']}")
    Path(args.out).write_text(json.dumps({"benchmark": "zero_reduce", "command": " ".join(["python", *sys.argv]),
                                          "results": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
