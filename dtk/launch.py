"""Starts the ranks of one run, watches them, shows one progress line, and writes summary.json.

The launcher hosts the run's TCPStore (node 0), so the store outlives any rank; it is also the supervisor:
it sees a rank die the moment it exits and, under `resilience.mode: inplace`, tells the survivors, starts the
replacement and publishes the recovery plan.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dtk import recipe as recipes
from dtk.errors import DtkError
from dtk.metrics import append_event, read_jsonl
from dtk.report import ProgressLine, write_summary

log = logging.getLogger(__name__)
POLL_SECONDS = 0.02


@dataclass(kw_only=True, slots=True)
class Topology:
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    """host:port of the store hosted by node 0's launcher; default: loopback and a free port."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_run_dir(recipe_path: str | None) -> Path:
    stem = Path(recipe_path).stem if recipe_path else "run"
    return Path("runs") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def prepare_run_dir(recipe: recipes.Recipe, recipe_path: str | None) -> Path:
    run_dir = Path(recipe.output.dir) if recipe.output.dir else default_run_dir(recipe_path)
    try:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DtkError(f"output.dir: got {str(run_dir)!r}; cannot create it ({e.strerror})") from None
    recipe.output.dir = str(run_dir)
    (run_dir / "recipe.yaml").write_text(recipes.dump(recipe))
    return run_dir


def signal_name(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def tail(path: Path, n: int = 12) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line for line in lines if line.strip()][-n:]


@dataclass(kw_only=True)
class Launcher:
    recipe: recipes.Recipe
    run_dir: Path
    topology: Topology = field(default_factory=Topology)
    show_progress: bool = True

    def __post_init__(self):
        self.world = self.recipe.world.nproc * self.topology.nnodes
        self.first_rank = self.topology.node_rank * self.recipe.world.nproc
        self.procs: dict[int, subprocess.Popen] = {}
        self.generation = 0
        self.failures: list[dict] = []
        self.messages: list[str] = []

    # -- processes --
    def _env(self, rank: int, join_generation: int | None) -> dict:
        env = dict(os.environ)
        env.update(RANK=str(rank), WORLD_SIZE=str(self.world), LOCAL_RANK=str(rank - self.first_rank),
                   LOCAL_WORLD_SIZE=str(self.recipe.world.nproc), DTK_RUN_DIR=str(self.run_dir),
                   DTK_STORE=self.address, OMP_NUM_THREADS=str(self.recipe.world.threads_per_rank),
                   PYTHONUNBUFFERED="1")
        env.setdefault("DS_ACCELERATOR", "cpu" if self.recipe.world.device == "cpu" else env.get("DS_ACCELERATOR", ""))
        if not env["DS_ACCELERATOR"]:
            del env["DS_ACCELERATOR"]
        env.pop("DTK_JOIN_GENERATION", None)
        if join_generation is not None:
            env["DTK_JOIN_GENERATION"] = str(join_generation)
        return env

    def spawn(self, rank: int, join_generation: int | None = None) -> subprocess.Popen:
        logf = open(self.run_dir / "logs" / f"rank{rank}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "dtk.worker"], env=self._env(rank, join_generation),
                                stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        logf.close()
        self.procs[rank] = proc
        self._write_pids()
        return proc

    def _write_pids(self) -> None:
        pids = {str(r): p.pid for r, p in self.procs.items()}
        (self.run_dir / "ranks.json").write_text(json.dumps({"launcher": os.getpid(), "ranks": pids}))

    def stop_all(self, grace_s: float = 3.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    # -- the run --
    def _open_store(self):
        import torch.distributed as dist

        if self.topology.rdzv_endpoint:
            host, _, port = self.topology.rdzv_endpoint.rpartition(":")
        else:
            host, port = "127.0.0.1", str(free_port())
        self.address = f"{host}:{port}"
        self.store = dist.TCPStore(host, int(port), is_master=self.topology.node_rank == 0, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=600))
        self.control = dist.PrefixStore("dtk", self.store)

    def run(self) -> int:
        self._open_store()
        t_start = time.time()
        for rank in range(self.first_rank, self.first_rank + self.recipe.world.nproc):
            self.spawn(rank)
        progress = ProgressLine(self.run_dir, total=self.recipe.training.steps, enabled=self.show_progress)
        code = 0
        try:
            with progress:
                code = self._supervise(progress)
        except KeyboardInterrupt:
            self.stop_all()
            code = 130
        finally:
            for line in self.messages:
                print(line, file=sys.stderr)
            write_summary(self.run_dir, wall_seconds=time.time() - t_start, failures=self.failures, exit_code=code)
        return code

    def _finished(self, rank: int) -> bool:
        return self.control.check([f"done/{rank}"])

    def _supervise(self, progress) -> int:
        while True:
            progress.update()
            running = False
            for rank, proc in list(self.procs.items()):
                code = proc.poll()
                if code is None:
                    running = True
                elif code != 0 and not self._finished(rank):
                    if not self._handle_failure(rank, code):
                        return 1
                    running = True
                elif code != 0:
                    log.warning("rank %d finished its steps, then exited with %s (teardown); run kept", rank,
                                signal_name(code))
            if not running:
                progress.update()
                return 0
            time.sleep(POLL_SECONDS)

    def _handle_failure(self, rank: int, code: int) -> bool:
        """A rank died. Returns True when the run goes on (recovered in place), False when it stops."""
        t_detect = time.time()
        r = self.recipe.resilience
        record = {"fault": signal_name(code), "rank": rank, "generation": self.generation, "detected_at": t_detect}
        started = all(self.control.check([f"started/{q}"]) for q in self.procs)
        if r.mode != "inplace" or len(self.failures) >= r.max_failures or not started:
            # (before every rank has started, the others are still in their first rendezvous: nothing to keep)
            self.stop_all()
            self.failures.append(record)
            append_event(self.run_dir, {"event": "failure", **record, "action": "stopped"})
            self.messages.append(f"error: rank {rank} failed ({signal_name(code)}); the run is stopped. "
                                 f"Last lines of {self.run_dir / 'logs' / f'rank{rank}.log'}:")
            self.messages += [f"  {line}" for line in tail(self.run_dir / "logs" / f"rank{rank}.log")]
            return False
        from dtk.resilience.supervisor import RecoveryFailed, recover_in_place

        try:
            record.update(recover_in_place(self, failed_rank=rank, t_detect=t_detect))
        except RecoveryFailed as e:
            self.stop_all()
            self.failures.append(record)
            append_event(self.run_dir, {"event": "failure", **record, "action": "recovery failed", "why": str(e)})
            self.messages.append(f"error: rank {rank} failed ({signal_name(code)}) and in-place recovery failed: {e}")
            for r in sorted(self.procs):
                self.messages += [f"  rank {r}: {line}" for line in tail(self.run_dir / "logs" / f"rank{r}.log", 4)]
            return False
        self.failures.append(record)
        append_event(self.run_dir, {"event": "failure", **record, "action": "recovered in place"})
        return True


def launch(recipe: recipes.Recipe, *, recipe_path: str | None, topology: Topology | None = None,
           show_progress: bool = True) -> tuple[int, Path]:
    run_dir = prepare_run_dir(recipe, recipe_path)
    launcher = Launcher(recipe=recipe, run_dir=run_dir, topology=topology or Topology(), show_progress=show_progress)
    return launcher.run(), run_dir
