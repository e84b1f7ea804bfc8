"""The checkpoint baseline's storage: torch.distributed.checkpoint (DCP) of every rank's engine state + the step.

A checkpoint is trusted only when whole: after DCP's save has returned on every rank, rank 0 writes manifest.json
(every file the save's .metadata names, with the bytes it must hold), atomically; a folder without it, or with a
file cut short since, is skipped on resume for the newest whole one."""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from dtk.errors import DtkError
from dtk.metrics import write_atomic
from dtk.resilience import protocol as keys

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _saved(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Every checkpoint folder, newest first, whole or not."""
    found = [(int(p.name[5:]), p) for p in checkpoint_dir(run_dir).glob("step_*") if p.name[5:].isdigit()]
    return sorted(found, reverse=True)


def damage(path: Path) -> str:
    """'' when the checkpoint in `path` is whole by its manifest, else what is wrong with it (for a line)."""
    try:
        need = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"it has no {MANIFEST} (its save did not finish)"
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {MANIFEST} is unreadable"
    return _missing(path, need)


def latest(run_dir: str | Path) -> tuple[int, Path] | None:
    """The newest whole checkpoint (see damage), as (step, path)."""
    return next(((step, p) for step, p in _saved(run_dir) if not damage(p)), None)


def resume_line(run_dir: str | Path) -> str:
    """Before a run resumes in `run_dir`: '' when its newest checkpoint is whole (or there is none); else the line
    that says which whole one it falls back to and why. DtkError when checkpoints are there and none is whole."""
    skipped: list[str] = []
    for step, p in _saved(run_dir):
        why = damage(p)
        if not why:
            if not skipped:
                return ""
            return (f"resuming from the checkpoint of step {step} ({p}): the newer one{'s' if len(skipped) > 1 else ''} "
                    f"cannot be trusted: {'; '.join(skipped)}")
        skipped.append(f"step_{step}: {why}")
    if skipped:
        raise DtkError(f"output.dir: got {str(run_dir)!r}; no checkpoint in it is whole ({'; '.join(skipped)}); "
                       f"accepted: a run folder with a whole checkpoint, or checkpoint.resume=never to start afresh")
    return ""


DISK_FULL = "No space left on device"
"""strerror(ENOSPC), as a rank's log or an OSError says it."""


def disk_is_full(run_dir: str | Path, *, probe_bytes: int = 1 << 20) -> bool:
    """Whether the run folder's disk has no room for `probe_bytes` more: asked after a rank failed, since a save cut
    short by a full disk does not always say ENOSPC (torch's zip writer reports 'unexpected pos ...')."""
    probe = Path(run_dir) / f".disk-probe.{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * probe_bytes)
            f.flush()
            os.fsync(f.fileno())
        return False
    except OSError as e:
        return e.errno == errno.ENOSPC
    finally:
        probe.unlink(missing_ok=True)


def disk_full_line(run_dir: str | Path) -> str:
    """The one line for a run stopped by a full disk: which folder, and what is kept (the newest whole checkpoint)."""
    found = latest(run_dir)
    kept = (f"the checkpoint of step {found[0]} ({found[1]}) is whole: free some space, or move the folder to a "
            f"larger disk, and run the same command with output.dir=<the folder> to resume from it" if found else
            "no whole checkpoint was saved before: free some space, or set output.dir on a larger disk, and start "
            "again")
    return f"error: output.dir: the disk holding {run_dir} is full ({DISK_FULL}); the run is stopped; {kept}."


def write_manifest(path: Path) -> None:
    """After the save returned on every rank: what a whole checkpoint holds, from its .metadata (every rank's files,
    even those on another host's disk); written last and atomically, so that its presence means a whole save."""
    write_atomic(path / MANIFEST, json.dumps({"files": _needed(path)}))


def save(engine, *, step: int, run_dir: str | Path, keep: int, whole: Callable[[], bool] = lambda: True) -> float:
    """Save the engine's state as checkpoints/step_<step>; rank 0 then writes its manifest, which makes it trusted,
    unless `whole()` says otherwise (in place: a peer failed during the save, and the collectives it was released
    from handed the others garbage)."""
    import torch.distributed.checkpoint as dcp  # here, not at the top: the launcher's latest() must not pay its 1.5 s

    t0 = time.perf_counter()
    path = checkpoint_dir(run_dir) / f"step_{step}"
    state = {"engine": engine.checkpoint_state(), "step": torch.tensor(step)}
    dcp.save(state, checkpoint_id=str(path))  # returns on every rank once .metadata is written
    if not whole():
        return time.perf_counter() - t0
    if dist.get_rank() == 0:
        write_manifest(path)
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


def missing_files(path: Path) -> str:
    """'' when `path` (a DCP folder whose save returned) holds every file its .metadata names, else which it lacks."""
    return _missing(path, _needed(path))


def _missing(path: Path, need: dict[str, int]) -> str:
    """'' when `path` holds every file of `need` in full, else which ones it lacks (for an error line)."""
    here = {p.name: p.stat().st_size for p in path.iterdir() if p.is_file()} if path.is_dir() else {}
    gone = [name for name, size in sorted(need.items()) if here.get(name, -1) < size]
    if not gone:
        return ""
    more = f" and {len(gone) - 3} more" if len(gone) > 3 else ""
    sizes = (f": {here[gone[0]]} of {need[gone[0]]} bytes" if len(gone) == 1 and gone[0] in here else "")
    return f"{path} lacks {', '.join(gone[:3])}{more} (absent or cut short{sizes})"


def check_shared(store, *, run_dir: str | Path, node_rank: int, nnodes: int, resume: str, timeout_s: float) -> None:
    """Before a multi-node run resumes, every host must read, in full, the checkpoint node 0 resumes from (every
    file its .metadata names); otherwise ranks load what their own disk holds (or nothing) and disagree on the step,
    or fail on a shard another host wrote to its own disk. Node 0 publishes its latest checkpoint on the store, every
    other node answers; a mismatch is one line on that node and on node 0, naming output.dir. Called by each node's
    launcher before it starts ranks."""
    if nnodes < 2 or resume != "auto":
        return
    import datetime
    import socket

    kv = dist.PrefixStore(keys.CHECKPOINT_SHARED_PREFIX, store)
    wait = datetime.timedelta(seconds=timeout_s)
    hint = "put output.dir on a file system every host can read (NFS, Lustre, ...)"
    if node_rank == 0:
        # the newest whole one; on disks not shared none is whole here: the newest DCP finished, to name what lacks
        found = latest(run_dir) or next(((k, p) for k, p in _saved(run_dir) if (p / ".metadata").is_file()), None)
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
