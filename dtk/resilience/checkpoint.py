"""The checkpoint baseline's storage: torch.distributed.checkpoint (DCP) of every rank's engine state + the step."""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest(run_dir: str | Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint (one with DCP's .metadata), as (step, path)."""
    found = []
    for p in checkpoint_dir(run_dir).glob("step_*"):
        if (p / ".metadata").is_file() and p.name[5:].isdigit():
            found.append((int(p.name[5:]), p))
    return max(found) if found else None


def save(engine, *, step: int, run_dir: str | Path, keep: int) -> float:
    import torch.distributed.checkpoint as dcp  # here, not at the top: the launcher's latest() must not pay its 1.5 s

    t0 = time.perf_counter()
    path = checkpoint_dir(run_dir) / f"step_{step}"
    state = {"engine": engine.checkpoint_state(), "step": torch.tensor(step)}
    dcp.save(state, checkpoint_id=str(path))
    if dist.get_rank() == 0:
        old = sorted((int(p.name[5:]), p) for p in checkpoint_dir(run_dir).glob("step_*") if p.name[5:].isdigit())
        for _, p in old[:-keep]:
            shutil.rmtree(p, ignore_errors=True)
    seconds = time.perf_counter() - t0
    log.info("checkpoint step %d saved in %.3fs", step, seconds)
    return seconds


def load(engine, path: Path) -> int:
    """Load a checkpoint into the live engine in place; returns the step it was taken after."""
    import torch.distributed.checkpoint as dcp

    engine.local_state()  # creates lazily-made optimizer state, so there is a tensor to load into
    state = {"engine": engine.checkpoint_state(), "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=str(path))
    engine.after_checkpoint_load(state["engine"])
    return int(state["step"])
