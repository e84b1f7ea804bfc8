"""The seam's per-call cost on CUDA: small all-reduces on the native NCCL group and on dtk's seam wrapping NCCL,
alternating, in one torchrun job (benchmarks/gpu.py runs it). Prints one JSON line on rank 0."""
from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

from dtk.comm.group import register

CALLS, REPS = 500, 5


def timed(group, t) -> float:
    for _ in range(20):
        dist.all_reduce(t, group=group)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        dist.all_reduce(t, group=group)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / CALLS


def main() -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    register(use_nccl=True, comm_mode="native")
    dist.init_process_group("nccl")
    groups = {"native": dist.group.WORLD, "seam": dist.new_group(backend="dtk")}
    t = torch.ones(1024, device="cuda")
    out = {"native": [], "seam": []}
    for rep in range(REPS):
        for name in (("native", "seam") if rep % 2 == 0 else ("seam", "native")):
            out[name].append(timed(groups[name], t))
    if rank == 0:
        med = {k: sorted(v)[len(v) // 2] for k, v in out.items()}
        print(json.dumps({"per_call_s": out, "median_s": med, "added_us": (med["seam"] - med["native"]) * 1e6,
                          "bytes": t.numel() * 4}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
