"""Per-step records (metrics.jsonl, written by rank 0) and run events (events.jsonl, appended by anyone)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path


class MetricsWriter:
    """metrics.jsonl, and each step's numbers to the recipe's other loggers (dtk.loggers)."""

    def __init__(self, run_dir: str | Path, *, loggers: list | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.events = Path(run_dir) / "events.jsonl"
        self.loggers = loggers or []

    def truncate_from(self, step: int) -> None:
        """A resumed run redoes steps >= step: drop their old records."""
        if self.path.exists():
            keep = [line for line in read_jsonl(self.path) if line.get("step", -1) < step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in keep))
        for logger in self.loggers:
            if hasattr(logger, "truncate_from"):
                logger.truncate_from(step)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()

    def has(self, step: int) -> bool:
        return any(r.get("step") == step for r in read_jsonl(self.path))

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.loggers and "loss" in record:
            from dtk.loggers import scalars_of

            numbers = scalars_of(record)
            for logger in self.loggers:
                logger.log(record["step"], numbers)

    def event(self, record: dict) -> None:
        append_event(self.events.parent, record)


def append_event(run_dir: str | Path, record: dict) -> None:
    line = json.dumps({"time": time.time(), **record}) + "\n"
    fd = os.open(Path(run_dir) / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())  # one write with O_APPEND: lines from several processes do not interleave
    finally:
        os.close(fd)


def write_atomic(path: str | Path, text: str) -> None:
    """Write `path` whole or not at all (a temp file renamed over it): a full disk or a crash never leaves a half-
    written one for a resume or a reader to trust."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_jsonl(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by a crash
    return out
