"""Plain torch DDP or FSDP2 on CUDA/NCCL, the shared workload (benchmarks/gpu.py runs it with torchrun); prints one
JSON line on rank 0 with tokens/s after the warm-up steps, timed as dtk times a step."""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import workload as w

p = argparse.ArgumentParser()
p.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
p.add_argument("--steps", type=int, default=40)
p.add_argument("--warmup", type=int, default=5)
a = p.parse_args()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
model = w.build_model().cuda()
if a.strategy == "ddp":
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
else:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
optimizer = w.build_optimizer(model.parameters())
data = w.SyntheticTokens(vocab_size=w.VOCAB, seq_len=w.SEQ_LEN, seed=w.SEED)
rank, world, times = dist.get_rank(), dist.get_world_size(), []
for step in range(a.steps):
    t0 = time.perf_counter()
    x, y = data.batch(step=step, rank=rank, micro=0, size=w.MICRO_BATCH)
    loss = w.loss_fn(model(x.cuda()), y.cuda())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss.item()
    times.append(time.perf_counter() - t0)
timed = times[a.warmup:]
if rank == 0:
    print(json.dumps({"tokens_per_s": len(timed) * w.MICRO_BATCH * w.SEQ_LEN * world / sum(timed)}))
dist.destroy_process_group()
