"""The learning rate of each step: linear warmup, then constant, cosine, linear or warmup-stable-decay (wsd).

The rate is a function of the step alone (no scheduler object with state), so a resumed run, a restarted rank and
an in-place recovery set exactly the rate the uninterrupted run set. Steps count from 0. Warmup step s uses
lr * (s+1) / (warmup+1), never 0 (torchtitan's choice); cosine and linear start at lr on the first step after
warmup and reach `min_lr` on the last step; wsd's decay takes its last `decay_steps` steps down to `min_lr`.
"""
from __future__ import annotations

import math


def lr_at(step: int, *, cfg, total_steps: int) -> float:
    """The rate of `step` (0-based) for the optimizer section `cfg` of a run of `total_steps` steps."""
    peak, low, warmup = cfg.lr, cfg.min_lr, cfg.warmup_steps
    n = step + 1
    if n <= warmup:
        return peak * n / (warmup + 1)
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "wsd":
        decay = decay_steps(cfg, total_steps=total_steps)
        start = total_steps - decay  # stable up to here, then a linear decay over the last `decay` steps
        if n <= start:
            return peak
        progress = (n - start) / decay
    else:
        progress = (step - warmup) / max(1, total_steps - 1 - warmup)
    progress = min(1.0, progress)
    if cfg.schedule == "cosine":
        return low + (peak - low) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return low + (peak - low) * (1.0 - progress)


def decay_steps(cfg, *, total_steps: int) -> int:
    """wsd's decay length: `decay_steps`, or the last 10% of the run (at least one step)."""
    return cfg.decay_steps if cfg.decay_steps is not None else max(1, total_steps // 10)


def set_lr(param_groups: list[dict], lr: float) -> None:
    for group in param_groups:
        group["lr"] = lr
