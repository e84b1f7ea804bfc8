"""The checkpoint baseline's storage: torch.distributed.checkpoint (DCP) of every rank's engine state + the step."""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dtk.resilience import protocol as keys

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



def _needed(path: Path) -> dict[str, int]:
    """The files a checkpoint's .metadata names (each rank's shards), with the bytes each must hold at least."""
    from torch.distributed.checkpoint import FileSystemReader

    need = {".metadata": (path / ".metadata").stat().st_size}
    for info in (FileSystemReader(str(path)).read_metadata().storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    return need


def _missing(path: Path, need: dict[str, int]) -> str:
    """'' when `path` holds every file of `need` in full, else which ones it lacks (for an error line)."""
    here = {p.name: p.stat().st_size for p in path.iterdir() if p.is_file()} if path.is_dir() else {}
    gone = [name for name, size in sorted(need.items()) if here.get(name, -1) < size]
    if not gone:
        return ""
    more = f" and {len(gone) - 3} more" if len(gone) > 3 else ""
    return f"{path} lacks {', '.join(gone[:3])}{more} (absent or cut short)"


def check_shared(store, *, run_dir: str | Path, node_rank: int, nnodes: int, resume: str, timeout_s: float) -> None:
    """Before a multi-node run resumes, every host must read, in full, the checkpoint node 0 resumes from (every
    file its .metadata names); otherwise ranks load what their own disk holds (or nothing) and disagree on the step,
    or fail on a shard another host wrote to its own disk. Node 0 publishes its latest checkpoint on the store, every
    other node answers; a mismatch is one line on that node and on node 0, naming output.dir. Called by each node's
    launcher before it starts ranks."""
    if nnodes < 2 or resume != "auto":
        return
    import datetime
    import json
    import socket

    from dtk.errors import DtkError

    kv = dist.PrefixStore(keys.CHECKPOINT_SHARED_PREFIX, store)
    wait = datetime.timedelta(seconds=timeout_s)
    hint = "put output.dir on a file system every host can read (NFS, Lustre, ...)"
    if node_rank == 0:
        found = latest(run_dir)
        need = _needed(found[1]) if found else {}
        kv.set(keys.CHECKPOINT_NODE0, json.dumps({"step": found[0] if found else None, "host": socket.gethostname(), "need": need}))
        if found is None:
            return  # nothing to resume from here: a host holding an older run's checkpoint refuses on its side
        bad = [f"this host (node 0): {mine}"] if (mine := _missing(found[1], need)) else []
        for k in range(1, nnodes):
            try:
                kv.wait([keys.checkpoint_verdict(k)], wait)
            except Exception:  # noqa: BLE001 - a host that never came: the rendezvous names it, not this check
                continue
            verdict = json.loads(kv.get(keys.checkpoint_verdict(k)))
            if verdict["problem"]:
                bad.append(f"node {k} ({verdict['host']}): {verdict['problem']}")
        if bad:
            raise DtkError(f"output.dir: got {str(run_dir)!r}; node 0 resumes from the checkpoint of step {found[0]}, "
                           f"but {'; '.join(bad)}; {hint}")
        return
    kv.wait([keys.CHECKPOINT_NODE0], wait)
    node0 = json.loads(kv.get(keys.CHECKPOINT_NODE0))
    newest = latest(run_dir)
    step = node0["step"]
    problem = ""
    if step is None and newest is not None:
        problem = f"it holds a checkpoint of step {newest[0]} that node 0 does not see"
    elif step is not None:
        problem = _missing(checkpoint_dir(run_dir) / f"step_{step}", node0["need"])
        if not problem and newest is not None and newest[0] != step:
            problem = f"its newest checkpoint is of step {newest[0]}, node 0's of step {step}"
    kv.set(keys.checkpoint_verdict(node_rank), json.dumps({"host": socket.gethostname(), "problem": problem}))
    if problem:
        where = f"node 0 ({node0['host']}) resumes from step {step}" if step is not None else "node 0 starts afresh"
        raise DtkError(f"output.dir: got {str(run_dir)!r}; {where}, but on this host (node {node_rank}, "
                       f"{socket.gethostname()}) {problem}; {hint}")
