"""Starts the ranks of one run, watches them, shows one progress line, and writes summary.json.

The launcher hosts the run's TCPStore (node 0), so the store outlives any rank; it is also the supervisor: it
sees a rank die the moment it exits, and a rank hang when its heartbeat stops advancing; then it stops the run,
restarts it from a checkpoint (`resilience.mode: checkpoint`) or recovers it in place (`inplace`).
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
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dtk import recipe as recipes
from dtk.errors import DtkError
from dtk.metrics import append_event
from dtk.report import ProgressLine, write_summary
from dtk.resilience import faults
from dtk.resilience.control import RUN_PREFIX, attempt_prefix
from dtk.resilience.live import LiveControl
from dtk.resilience.supervisor import (HangWatch, RecoveryFailed, describe_failure, finalize_failures,
                                       recover_in_place, restart_from_checkpoint, signal_name)

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
    faults: list = field(default_factory=list)
    """Faults (dtk.resilience.faults.Fault) to inject; more can arrive while running (`dtk inject-failure --run`)."""
    fault_schedule: list = field(default_factory=list)
    """(seconds after start, rank) of random faults of kind `schedule_kind` (--mtbf)."""
    schedule_kind: str = "kill"

    def __post_init__(self):
        self.world = self.recipe.world.nproc * self.topology.nnodes
        self.first_rank = self.topology.node_rank * self.recipe.world.nproc
        self.procs: dict[int, subprocess.Popen] = {}
        self.generation = 0
        self.attempt = 0
        self.failures: list[dict] = []
        self.messages: list[str] = []
        self.hangs = HangWatch(timeout_s=self.recipe.resilience.heartbeat_timeout_s)
        self._fault_lock = threading.Lock()
        self._live_count = 0
        self.attributed: set[str] = set()

    # -- processes --
    def _env(self, rank: int, join_generation: int | None) -> dict:
        env = dict(os.environ)
        env.update(RANK=str(rank), WORLD_SIZE=str(self.world), LOCAL_RANK=str(rank - self.first_rank),
                   LOCAL_WORLD_SIZE=str(self.recipe.world.nproc), DTK_RUN_DIR=str(self.run_dir),
                   DTK_STORE=self.address, OMP_NUM_THREADS=str(self.recipe.world.threads_per_rank),
                   DTK_ATTEMPT=str(self.attempt), DTK_SPAWNED_AT=repr(time.time()), PYTHONUNBUFFERED="1")
        if self.recipe.world.device == "cpu" or not env.get("DS_ACCELERATOR"):
            env["DS_ACCELERATOR"] = "cpu" if self.recipe.world.device != "cuda" else "cuda"
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

    def spawn_all(self) -> None:
        for rank in range(self.first_rank, self.first_rank + self.recipe.world.nproc):
            self.spawn(rank)

    def _write_pids(self) -> None:
        pids = {str(r): p.pid for r, p in self.procs.items()}
        (self.run_dir / "ranks.json").write_text(json.dumps({"launcher": os.getpid(), "ranks": pids}))

    def stop_all(self, grace_s: float = 3.0) -> None:
        """SIGTERM every rank, SIGKILL what is left after grace_s (0: SIGKILL at once)."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    # -- the store and what crosses it --
    def _open_store(self):
        import torch.distributed as dist

        if self.topology.rdzv_endpoint:
            host, _, port = self.topology.rdzv_endpoint.rpartition(":")
        else:
            host, port = "127.0.0.1", str(free_port())
        self.address = f"{host}:{port}"
        self.store = dist.TCPStore(host, int(port), is_master=self.topology.node_rank == 0, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=600))
        self.run_store = dist.PrefixStore(RUN_PREFIX, self.store)
        self._set_attempt(0)

    def _set_attempt(self, attempt: int) -> None:
        import torch.distributed as dist

        self.attempt, self.generation = attempt, 0
        self.control = dist.PrefixStore(attempt_prefix(attempt), self.store)
        self.hangs.reset()
        self._all_started = False

    def deliver(self, fault) -> None:
        """Announce a fault to its rank (read at start-up and polled while running)."""
        with self._fault_lock:
            key = f"faults/{fault.rank}"
            known = json.loads(self.run_store.get(key)) if self.run_store.check([key]) else []
            known.append(asdict(fault))
            self.run_store.set(key, json.dumps(known))

    def live_faults(self, specs: list[str]) -> list[str]:
        """From `dtk inject-failure --run`: parse (DtkError on a bad one: nothing is scheduled) and deliver."""
        with self._fault_lock:
            start = self._live_count
            self._live_count += len(specs)
        parsed = [faults.parse(s, world=self.world, fault_id=f"live{start + i}", flag="fault") for i, s in enumerate(specs)]
        for f in parsed:
            self.deliver(f)
        append_event(self.run_dir, {"event": "faults scheduled", "faults": [f.spec() for f in parsed]})
        return [f.spec() for f in parsed]

    def fired(self) -> list[dict]:
        """The faults that have fired so far (each recorded by its rank just before it acted)."""
        out = []
        for f in self._announced():
            key = f"fired/{f['id']}"
            if self.run_store.check([key]):
                out.append(json.loads(self.run_store.get(key)))
        return out

    def _announced(self) -> list[dict]:
        out = []
        for rank in range(self.world):
            key = f"faults/{rank}"
            if self.run_store.check([key]):
                out += json.loads(self.run_store.get(key))
        return out

    # -- the run --
    def run(self) -> int:
        self._open_store()
        for f in self.faults:
            self.deliver(f)
        live = LiveControl(self.run_dir, self.live_faults)
        self.t_start = time.time()
        self.spawn_all()
        progress = ProgressLine(self.run_dir, total=self.recipe.training.steps, enabled=self.show_progress)
        code = 0
        try:
            with progress:
                code = self._supervise(progress)
        except KeyboardInterrupt:
            self.stop_all()
            code = 130
        finally:
            live.close()
            for line in self.messages:
                print(line, file=sys.stderr)
            finalize_failures(self)
            write_summary(self.run_dir, wall_seconds=time.time() - self.t_start, failures=self.failures,
                          exit_code=code)
        return code

    def _finished(self, rank: int) -> bool:
        return self.control.check([f"done/{rank}"])

    def _started(self) -> bool:
        """Every rank of this attempt has built its engine (remembered: the supervisor asks 50 times a second)."""
        if not self._all_started:
            self._all_started = all(self.control.check([f"started/{q}"]) for q in self.procs)
        return self._all_started

    def _supervise(self, progress) -> int:
        next_random, next_progress = 0, 0.0
        while True:
            if time.monotonic() >= next_progress:  # the ranks need the CPU more than the progress line does
                progress.update()
                next_progress = time.monotonic() + 0.2
            now = time.time() - self.t_start
            while next_random < len(self.fault_schedule) and self.fault_schedule[next_random][0] <= now:
                _, rank = self.fault_schedule[next_random]
                self.deliver(faults.Fault(kind=self.schedule_kind, rank=rank, id=f"mtbf{next_random}"))
                next_random += 1
            running = False
            for rank, proc in list(self.procs.items()):
                code = proc.poll()
                if code is None:
                    running = True
                elif code != 0 and not self._finished(rank):
                    if not self._handle_failure(rank, code):
                        return 1
                    running = True
                    break  # the set of processes may have changed
                elif code != 0:
                    log.warning("rank %d finished its steps, then exited with %s (teardown); run kept", rank,
                                signal_name(code))
            if not running:
                progress.update()
                return 0
            if self._started():
                for rank in self.hangs.check(self.control, sorted(self.procs)):
                    self.procs[rank].kill()  # a hung rank is removed; its death is then handled as any other
            time.sleep(POLL_SECONDS)

    def _handle_failure(self, rank: int, code: int) -> bool:
        """A rank died. Returns True when the run goes on (recovered), False when it stops."""
        t_detect = time.time()
        r = self.recipe.resilience
        record = describe_failure(self, rank=rank, code=code, t_detect=t_detect)
        started = self._started()
        if r.mode == "none" or len(self.failures) >= r.max_failures or not started:
            # (before every rank has started, the others are still in their first rendezvous: nothing to keep)
            self.stop_all()
            self.failures.append(record)
            append_event(self.run_dir, {"event": "failure", **record, "action": "stopped"})
            why = "" if r.mode == "none" else (" (resilience.max_failures reached)" if started else " before every rank started")
            self.messages.append(f"error: rank {rank} failed ({record['fault']}){why}; the run is stopped. "
                                 f"Last lines of {self.run_dir / 'logs' / f'rank{rank}.log'}:")
            self.messages += [f"  {line}" for line in tail(self.run_dir / "logs" / f"rank{rank}.log")]
            return False
        if r.mode == "checkpoint":
            record.update(restart_from_checkpoint(self, t_detect=t_detect))
            self.failures.append(record)
            append_event(self.run_dir, {"event": "failure", **record, "action": "restarted from checkpoint"})
            return True
        try:
            record.update(recover_in_place(self, failed_rank=rank, t_detect=t_detect))
            self.hangs.reset()  # the replacement's heartbeats start afresh
        except RecoveryFailed as e:
            self.stop_all()
            self.failures.append(record)
            append_event(self.run_dir, {"event": "failure", **record, "action": "recovery failed", "why": str(e)})
            self.messages.append(f"error: rank {rank} failed ({record['fault']}) and in-place recovery failed: {e}")
            for q in sorted(self.procs):
                self.messages += [f"  rank {q}: {line}" for line in tail(self.run_dir / "logs" / f"rank{q}.log", 4)]
            return False
        self.failures.append(record)
        append_event(self.run_dir, {"event": "failure", **record, "action": "recovered in place"})
        return True


def launch(recipe: recipes.Recipe, *, recipe_path: str | None, topology: Topology | None = None,
           show_progress: bool = True, inject: list | None = None, fault_schedule: list | None = None,
           schedule_kind: str = "kill") -> tuple[int, Path]:
    run_dir = prepare_run_dir(recipe, recipe_path)
    launcher = Launcher(recipe=recipe, run_dir=run_dir, topology=topology or Topology(), show_progress=show_progress,
                        faults=list(inject or []), fault_schedule=list(fault_schedule or []), schedule_kind=schedule_kind)
    return launcher.run(), run_dir
