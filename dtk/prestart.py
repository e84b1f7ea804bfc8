"""Rank processes started before the launcher imports torch: `dtk train` starts this node's ranks as soon as the
recipe loads (a bad --fault flag found after ends them), so that their imports (torch, torch._dynamo, which DDP's
constructor imports, dtk's engines: about 2.5 s of a rank's start) run while the launcher imports torch and opens
the run's store (1.5-2 s), instead of after. A prestarted process (`python -m dtk.worker --prestarted`) imports,
then reads one line on its stdin: its environment and log file, which the launcher knows only later
(`Prestarted.hand_over`). End of input (the launcher ended before it started the ranks) ends it. Torch-free:
imported before torch."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from dtk.parentdeath import die_with_parent


def rank_preexec() -> None:
    """In a rank's process before exec: die with the launcher (Linux), ignore Ctrl-C (the launcher handles it for
    the whole run: it stops the ranks and says where the run stands), and block SIGTERM (its mask is kept across
    exec; dtk.worker's watch thread tells the launcher's from another's)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # taken by one thread of the rank (dtk.worker)
    die_with_parent()


def ds_accelerator(device: str, env: dict) -> str:
    """DS_ACCELERATOR for a rank (DeepSpeed reads it once, at import): the recipe's device, unless it leaves the
    choice open and the user set one."""
    if device == "cpu" or not env.get("DS_ACCELERATOR"):
        return "cuda" if device == "cuda" else "cpu"
    return env["DS_ACCELERATOR"]


class Prestarted:
    """`count` rank processes importing; the launcher hands each its rank with `hand_over`, `close` ends the rest."""

    def __init__(self, count: int, *, threads_per_rank: int, device: str, deepspeed: bool) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads_per_rank), PYTHONUNBUFFERED="1")
        env["DS_ACCELERATOR"] = ds_accelerator(device, env)
        what = ["--prestarted"] + (["deepspeed"] if deepspeed else [])
        self.waiting = [subprocess.Popen([sys.executable, "-m", "dtk.worker", *what], env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, preexec_fn=rank_preexec)
                        for _ in range(count)]

    def hand_over(self, env: dict, log: str) -> subprocess.Popen | None:
        """A waiting process becomes the rank that `env` describes, writing to `log`; None when none is left."""
        while self.waiting:
            proc = self.waiting.pop(0)
            if proc.poll() is not None:
                # it crashed importing (an import that raises waits for its order and raises in the rank's log):
                continue  # the launcher starts the rank the usual way, and its log shows why
            try:
                assert proc.stdin is not None
                proc.stdin.write((json.dumps({"env": env, "log": log}) + "\n").encode())
                proc.stdin.close()
            except BrokenPipeError:
                continue
            return proc
        return None

    def close(self) -> None:
        """End the processes not handed over: they hold nothing yet."""
        for proc in self.waiting:
            proc.kill()
            proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()
        self.waiting = []


def become(order_line: str) -> None:
    """In the prestarted process: take the environment and log file the launcher handed over."""
    order = json.loads(order_line)
    os.environ.clear()
    os.environ.update(order["env"])
    write_to(order["log"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)


def write_to(log: str) -> None:
    """This process's stdout and stderr (fds 1 and 2) append to `log` from now on."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
