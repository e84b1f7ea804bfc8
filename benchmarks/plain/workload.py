"""What every plain script trains: dtk's GPT on dtk's synthetic tokens, with the optimizer settings and step timing
that benchmarks/overhead.py gives `dtk train`, so only the training code around them differs."""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Callable

import torch
import torch.distributed as dist

from dtk.data.synthetic import SyntheticTokens
from dtk.models.gpt import GPT
from dtk.models.init import Blueprint
from dtk.trainer import step_seed

# Keep in step with benchmarks/overhead.py's dtk overrides.
MODEL = {"layers": 4, "width": 256, "heads": 4}
VOCAB, SEQ_LEN, MICRO_BATCH, SEED = 64, 64, 8, 0
LR, BETAS = 0.003, (0.9, 0.95)


def parse_args(extra: dict | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="Steps left out of the timing.")
    p.add_argument("--backend", choices=["gloo", "dtk"], default="gloo",
                   help="dtk: the same script on dtk's seam (registered backend wrapping gloo).")
    p.add_argument("--out", help="JSON file rank 0 writes: steps/s, step times, final loss.")
    for flag, kwargs in (extra or {}).items():
        p.add_argument(flag, **kwargs)
    return p.parse_args()


def init(backend: str) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if backend == "dtk":
        from dtk.comm.group import register

        register()
    dist.init_process_group(backend)


def build_model() -> torch.nn.Module:
    return seeded(lambda: GPT(vocab_size=VOCAB, context=SEQ_LEN, **MODEL))


def seeded(construct: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """The model `construct` builds, with the values dtk gives it for SEED: the same weights on every rank, and the
    same as dtk's (dtk seeds each module from its name, dtk.models.init; a plain `torch.manual_seed` + build would
    draw other numbers). The values do not depend on the groups it is filled by, so one group will do."""
    return Blueprint(construct=construct, seed=SEED, units=lambda model: []).full()


def build_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=0.0, foreach=False)


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def train(step_fn, args: argparse.Namespace) -> None:
    """Run `step_fn(x, y) -> loss` for args.steps steps; each step is timed as dtk times its own (batch to
    update done), and rank 0 writes the result."""
    rank, world = dist.get_rank(), dist.get_world_size()
    data = SyntheticTokens(vocab_size=VOCAB, seq_len=SEQ_LEN, seed=SEED)
    times, loss = [], torch.zeros(())
    for step in range(args.steps):
        t0 = time.perf_counter()
        torch.manual_seed(step_seed(SEED, step, rank))  # dropout draws what dtk's step draws
        x, y = data.batch(step=step, rank=rank, micro=0, size=MICRO_BATCH)
        loss = step_fn(x, y).detach()
        loss.item()
        times.append(time.perf_counter() - t0)
    final = loss.clone().double()
    dist.all_reduce(final)
    timed = times[args.warmup:] or times
    if rank == 0 and args.out:
        result = {"steps_per_s": len(timed) / sum(timed), "step_seconds": times, "warmup": args.warmup,
                  "final_loss": float(final) / world, "world_size": world, "backend": args.backend}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()
