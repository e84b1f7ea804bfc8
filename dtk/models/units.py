"""What is done to each wrap unit (transformer block) before a strategy wraps it: activation checkpointing
(`training.activation_checkpointing`) and torch.compile (`training.compile`), under every strategy."""
from __future__ import annotations

import functools
import shutil
from typing import Callable, Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from dtk.models.wrap import find_wrap_units

Checkpointing = Literal["none", "full", "selective"]

# Selective checkpointing keeps what is costly to redo (matrix products, attention) and recomputes the rest
# (norms, activations, adds): most of a block's saved bytes for a few per cent of its time (torchtitan's op policy).
_SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
              torch.ops.aten._scaled_dot_product_flash_attention.default,
              torch.ops.aten._scaled_dot_product_efficient_attention.default,
              torch.ops.aten._scaled_dot_product_cudnn_attention.default}


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(forward: Callable, *, selective: bool) -> Callable:
    # non-reentrant: works with keyword arguments, FSDP2's and DeepSpeed's hooks, and keeps the RNG of dropout
    context = functools.partial(create_selective_checkpoint_contexts, _policy) if selective else None

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if context is None:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)
    return run


def prepare_units(model: nn.Module, *, names: list[str] | tuple[str, ...] = (), checkpointing: Checkpointing = "none",
                  compile: bool = False) -> int:
    """Change each wrap unit's forward in place (its parameters keep their names, so checkpoints and shards are
    unchanged): compiled, then checkpointed around the compiled code. Only the forward is replaced: the unit's hooks
    (FSDP2's gather, DeepSpeed's fetch) stay eager, outside the compiled and the recomputed code. Returns the count."""
    if checkpointing == "none" and not compile:
        return 0
    units = find_wrap_units(model, names=names).modules or [model]
    for unit in units:
        forward = unit.forward
        if compile:
            forward = torch.compile(forward)
        if checkpointing != "none":
            forward = _checkpointed(forward, selective=checkpointing == "selective")
        unit.forward = forward
    return len(units)


def compiler_problem() -> str | None:
    """torch.compile's inductor backend builds C++ for CPU code: without a compiler every rank would fail in its
    first step, so the recipe check says it first. (CUDA kernels are Triton's, but the host code needs one too.)"""
    from torch._inductor import config

    candidates = [c for c in (config.cpp.cxx if isinstance(config.cpp.cxx, (tuple, list)) else [config.cpp.cxx]) if c]
    found = [c for c in candidates if shutil.which(c)]
    if found:
        return None
    return (f"training.compile: got true; torch.compile's inductor backend needs a C++ compiler and "
            f"{' or '.join(candidates) or 'g++'} is not on PATH; accepted: install one (apt-get install g++, or name it "
            f"in CXX) or training.compile: false")
