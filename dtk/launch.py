"""Starts the ranks of one run, watches them, shows one progress line, and writes summary.json.

The launcher hosts the run's TCPStore (node 0), so the store outlives any rank; it is also the supervisor: it
sees a rank die the moment it exits, and a rank hang when its heartbeat stops advancing; then it stops the run,
restarts it from a checkpoint (`resilience.mode: checkpoint`) or recovers it in place (`inplace`).
"""
from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dtk import recipe as recipes
from dtk.errors import DtkError
from dtk.metrics import append_event
from dtk.report import ProgressLine, write_summary
from dtk.resilience import faults
from dtk.resilience.checkpoint import DISK_FULL, disk_full_line
from dtk.resilience.control import PREEMPT_KEY, RUN_PREFIX, attempt_prefix
from dtk.resilience.live import LiveControl
from dtk.resilience.recovery import RecoveryFailed, recover_in_place
from dtk.resilience.shadow import ShadowPool
from dtk.resilience.supervisor import (HangWatch, StormWatch, describe_failure, finalize_failures,
                                       restart_from_checkpoint, signal_name)

log = logging.getLogger(__name__)
POLL_SECONDS = 0.02
SHADOW_IDS_PER_NODE = 1000
LEAVE_WAIT_S = 15.0
"""How long node 0's launcher (it hosts the store) waits at the end for the other nodes' launchers to leave."""
PREEMPT_WAIT_S = 120.0
"""After SIGTERM, how long the ranks may take to finish their step and save it before they are stopped."""
SIGTERM_EXIT = 128 + signal.SIGTERM


@dataclass(kw_only=True, slots=True)
class Topology:
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    """host:port of the store hosted by node 0's launcher; default: loopback and a free port."""


def dist_error() -> type:
    import torch.distributed as dist

    return dist.DistError


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
    # every node's launcher writes it (a run folder need not be shared), while ranks may be reading it: atomically
    tmp = run_dir / f".recipe.yaml.{os.getpid()}"
    tmp.write_text(recipes.dump(recipe))
    os.replace(tmp, run_dir / "recipe.yaml")
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
    live_control: bool = True
    """Serve `dtk inject-failure --run` (node 0 only; off where a test bed's driver serves it for the run)."""

    def __post_init__(self):
        self.world = self.recipe.world.nproc * self.topology.nnodes
        self.first_rank = self.topology.node_rank * self.recipe.world.nproc
        self.hosted = list(range(self.first_rank, self.first_rank + self.recipe.world.nproc))
        """The ranks this node starts in an attempt: its own, plus a lost node's after a checkpoint restart."""
        self.procs: dict[int, subprocess.Popen] = {}
        self.generation = 0
        self.attempt = 0
        self.failures: list[dict] = []
        self.messages: list[str] = []
        self.hangs = HangWatch(fixed_s=self.recipe.resilience.heartbeat_timeout_s)
        self.storm = StormWatch()
        self.shadows: ShadowPool | None = None
        self._fault_lock = threading.Lock()
        self._live_count = 0
        self.attributed: set[str] = set()
        self.remote_failures: list[dict] = []
        """Failures another node's launcher reported when it stopped the run (multi-node)."""
        node = self.topology.node_rank
        # one run folder for every node: node 0 owns summary.json and ranks.json, the others write their own
        self.summary_name = "summary.json" if node == 0 else f"summary-node{node}.json"
        self.pids_name = "ranks.json" if node == 0 else f"ranks-node{node}.json"

    # -- processes --
    def _env(self, rank: int, join_generation: int | None, shadow_id: int | None = None) -> dict:
        env = dict(os.environ)
        env.update(RANK=str(rank), WORLD_SIZE=str(self.world), LOCAL_RANK=str(rank - self.first_rank),
                   LOCAL_WORLD_SIZE=str(self.recipe.world.nproc), DTK_RUN_DIR=str(self.run_dir),
                   DTK_STORE=self.address, OMP_NUM_THREADS=str(self.recipe.world.threads_per_rank),
                   DTK_ATTEMPT=str(self.attempt), DTK_SPAWNED_AT=repr(time.time()), PYTHONUNBUFFERED="1")
        from dtk.netif import backend_env  # world.interface: GLOO/NCCL_SOCKET_IFNAME (picked once, printed once)
        env.update(backend_env(self.recipe.world.interface, endpoint=self.address, multi_node=self.topology.nnodes > 1))
        if self.recipe.world.device == "cpu" or not env.get("DS_ACCELERATOR"):
            env["DS_ACCELERATOR"] = "cpu" if self.recipe.world.device != "cuda" else "cuda"
        env.pop("DTK_JOIN_GENERATION", None)
        env.pop("DTK_SHADOW", None)
        if join_generation is not None:
            env["DTK_JOIN_GENERATION"] = str(join_generation)
        if shadow_id is not None:
            env["DTK_SHADOW"] = str(shadow_id)
        return env

    def _popen(self, log_name: str, env: dict) -> subprocess.Popen:
        logf = open(self.run_dir / "logs" / log_name, "ab")
        try:
            # a rank dies with its launcher, and leaves Ctrl-C to it (the launcher stops the ranks and reports)
            return subprocess.Popen([sys.executable, "-m", "dtk.worker"], env=env, stdout=logf,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_rank_preexec)
        finally:
            logf.close()

    def spawn(self, rank: int, join_generation: int | None = None) -> subprocess.Popen:
        proc = self._popen(f"rank{rank}.log", self._env(rank, join_generation))
        self.procs[rank] = proc
        self._write_pids()
        return proc

    def spawn_shadow(self, shadow_id: int) -> subprocess.Popen:
        proc = self._popen(f"shadow{shadow_id}.log", self._env(self.first_rank, None, shadow_id))
        append_event(self.run_dir, {"event": "shadow started", "shadow": shadow_id, "pid": proc.pid,
                                    "attempt": self.attempt})
        return proc

    def spawn_all(self) -> None:
        for rank in self.hosted:
            self.spawn(rank)

    def start_attempt(self, attempt: int) -> None:
        """Start every rank (and the shadows) of an attempt; attempt 0 is the run's start, later ones restarts."""
        if attempt:
            self._set_attempt(attempt)
            if self.view is not self and not self.topology.node_rank:  # every node restarts with node 0
                self.hosted = self.view.announce_restart(attempt)
        self.procs = {}
        self.spawn_all()
        if self.shadows is not None:
            self.shadows.stop()
        count = self.recipe.resilience.shadows
        if self.recipe.resilience.mode == "inplace" and count:
            # shadow ids are keys in the run's one store: each node numbers its own from node_rank * 1000
            self.shadows = ShadowPool(count=count, spawn=self.spawn_shadow, control=self.control,
                                      started=SHADOW_IDS_PER_NODE * self.topology.node_rank)
            self.shadows.start()

    # -- what recovery may do (dtk.resilience.recovery.RunView) --
    def ranks(self) -> list[int]:
        return sorted(self.procs)

    def dead(self) -> list[int]:
        return [r for r, p in self.procs.items() if p.poll() not in (None, 0)]

    def replace(self, rank: int, generation: int) -> dict:
        """A promoted shadow takes `rank`, else a cold process; every decision goes to events.jsonl."""
        shadow = self.shadows.promote(rank=rank, generation=generation) if self.shadows else None
        if shadow is not None:
            self.procs[rank] = shadow.proc
            self._write_pids()
            how = {"replacement": "shadow", "shadow": shadow.id, "pid": shadow.proc.pid,
                   "shadow_started_at": shadow.started_at, "shadow_was_ready": shadow.ready is not None}
        else:
            proc = self.spawn(rank, join_generation=generation)
            why = "resilience.shadows is 0" if not self.recipe.resilience.shadows else "no shadow left"
            how = {"replacement": "cold", "pid": proc.pid, "why": why}
        append_event(self.run_dir, {"event": "replacement", "rank": rank, "generation": generation, **how})
        return how

    def _write_pids(self) -> None:
        pids = {str(r): p.pid for r, p in self.procs.items()}
        (self.run_dir / self.pids_name).write_text(json.dumps({"launcher": os.getpid(), "ranks": pids}))

    def stop_all(self, grace_s: float = 3.0) -> None:
        """SIGTERM every rank, SIGKILL what is left after grace_s (0: SIGKILL at once). Shadows stay (see run)."""
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
        faults.announce(self.run_store, fault)

    def live_faults(self, specs: list[str]) -> list[str]:
        """From `dtk inject-failure --run`: parse (DtkError on a bad one: nothing is scheduled) and deliver."""
        with self._fault_lock:
            start = self._live_count
            self._live_count += len(specs)
        parsed = [faults.parse(s, world=self.world, fault_id=f"live{start + i}", flag="fault",
                               nodes=self.topology.nnodes) for i, s in enumerate(specs)]
        faults.check_reachable(parsed, steps=self.recipe.training.steps, mode=self.recipe.resilience.mode, flag="fault")
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

    def fired_ids(self) -> list[str]:
        """For summary.json: a chaos run whose faults did not fire tested nothing, and the CLI says so."""
        try:
            return [f["id"] for f in self.fired()]
        except dist_error():
            return []  # node 0's store is gone (another node's launcher, at the end)

    def _announced(self) -> list[dict]:
        out = []
        for rank in range(self.world):
            key = f"faults/{rank}"
            if self.run_store.check([key]):
                out += json.loads(self.run_store.get(key))
        return out

    # -- the run --
    def _join_nodes(self) -> None:
        """Multi-node: every node but 0 beats and node 0 watches the beats (a lost host); in place, node 0
        coordinates every node's recoveries (dtk.resilience.nodes)."""
        self.view = self  # what the recovery sequence acts on (dtk.resilience.recovery.RunView)
        self.reporter = self.node_beat = self.node_watch = None
        self.reported_dead: dict[int, dict] = {}
        self._fenced = False
        if self.topology.nnodes == 1:
            return
        from dtk.resilience.nodes import Coordinator, NodeBeat, NodeReporter, NodeWatch

        node = self.topology.node_rank
        if node:
            self.node_beat = NodeBeat(run_store=self.run_store, node=node)
        else:
            self.node_watch = NodeWatch(run_store=self.run_store, nnodes=self.topology.nnodes)
        if self.recipe.resilience.mode not in ("inplace", "checkpoint"):
            return  # mode none: the node whose rank failed stops the run everywhere
        if node == 0:
            self.view = Coordinator(launcher=self, run_store=self.run_store, nnodes=self.topology.nnodes,
                                    nproc=self.recipe.world.nproc, watch=self.node_watch)
        else:
            self.reporter = NodeReporter(run_store=self.run_store, node=node)

    def _replace_for_node0(self, rank: int, generation: int) -> dict:
        how = self.replace(rank, generation)
        self.hangs.reset()  # the replacement's heartbeats start afresh
        if self.shadows:
            self.shadows.replenish()
        return how

    def _exit_code(self, rank: int) -> int | None:
        """None: the rank was on a lost node (nobody saw it exit)."""
        if rank in self.procs:
            return self.procs[rank].returncode
        return self.view.remote_dead().get(rank, {}).get("code")  # a rank of another node (node 0 coordinates)

    def lost_node_of(self, rank: int) -> int | None:
        """Node 0: the lost node that hosted `rank`, if it was lost with its node."""
        if self.node_watch is None or rank in self.procs:
            return None
        node = self.view.node_of(rank) if self.view is not self else rank // self.recipe.world.nproc
        return node if node in self.node_watch.lost else None

    def hang_detected_at(self, rank: int) -> float | None:
        """When a heartbeat found `rank` hung: here, or (a rank of another node) by the node that removed it."""
        if rank in self.hangs.hung:
            return self.hangs.hung[rank]
        if rank in self.procs or self.view is self:
            return None
        return self.view.remote_dead().get(rank, {}).get("hang_detected_at")

    def run(self) -> int:
        self._open_store()
        from dtk.resilience.checkpoint import check_shared  # multi-node resume: every host reads node 0's checkpoint
        check_shared(self.store, run_dir=self.run_dir, node_rank=self.topology.node_rank, nnodes=self.topology.nnodes,
                     resume=self.recipe.checkpoint.resume, timeout_s=self.recipe.world.timeout_s)
        self._join_nodes()
        self.run_store.set(f"joined/{self.topology.node_rank}", json.dumps({"host": socket.gethostname(),
                                                                            "pid": os.getpid()}))
        self._absent: list[int] | None = None if self.topology.nnodes > 1 and not self.topology.node_rank else []
        for f in self.faults:
            self.deliver(f)
        live = LiveControl(self.run_dir, self.live_faults) if self.live_control and not self.topology.node_rank else None
        self.t_start = time.time()
        self.t_train: float | None = None
        self._resumed_at: float | None = None
        self._sigterm = False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
        self.start_attempt(0)
        progress = ProgressLine(self.run_dir, total=self.recipe.training.steps, enabled=self.show_progress)
        code = 0
        disk_full = False
        try:
            with progress:
                code = self._supervise(progress)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            self.stop_all()
            code, disk_full = 1, True
        except KeyboardInterrupt:
            self.stop_all()
            code = 130
            append_event(self.run_dir, {"event": "interrupted", "by": "the user (Ctrl-C)"})
        except dist_error() as e:
            if not self.topology.node_rank:
                raise  # node 0 hosts the store: losing it is a bug
            self.stop_all()
            code = 1
            self.messages.append(f"error: node {self.topology.node_rank} lost the run's store on node 0 ({e!s:.80}); "
                                 "its ranks are stopped.")
        finally:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if live is not None:
                live.close()
            shadows = self.shadows.summary() if self.shadows else {"count": 0, "promotions": 0, "rss_bytes": []}
            if self.shadows:
                self.shadows.stop()
            try:
                finalize_failures(self)
                write_summary(self.run_dir, wall_seconds=time.time() - self.t_start,
                              failures=self.failures + self.remote_failures,
                              exit_code=code, shadows=shadows, name=self.summary_name, world_size=self.world,
                              faults_fired=self.fired_ids(),
                              resilience={"mode": self.recipe.resilience.mode, **self.hangs.describe()})
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                code, disk_full = code or 1, True
            if disk_full or (code and any(DISK_FULL in line for line in self.messages)):
                self.messages = [disk_full_line(self.run_dir)]  # a rank's traceback would only repeat it
            for line in self.messages:
                print(line, file=sys.stderr)
            if self.topology.nnodes > 1:
                self._leave(code)
        return code

    def _on_sigterm(self, signum, frame) -> None:
        self._sigterm = True  # acted on by the watch loop, between two of its decisions (never mid-recovery)

    def _preempt(self) -> int:
        """SIGTERM (Slurm, Kubernetes): like Ctrl-C, but with checkpoints on, every rank first finishes its step and
        saves it (dtk.trainer), so that a preempted job loses nothing."""
        saving = bool(self.recipe.checkpoint.every) and self._started()
        append_event(self.run_dir, {"event": "interrupted", "by": "SIGTERM", "saving": saving})
        if saving:
            self.control.set(PREEMPT_KEY, "1")
            deadline = time.monotonic() + PREEMPT_WAIT_S
            while time.monotonic() < deadline and any(p.poll() is None for p in self.procs.values()):
                time.sleep(POLL_SECONDS)
        self.stop_all()
        return SIGTERM_EXIT

    def _finished(self, rank: int) -> bool:
        return self.control.check([f"done/{rank}"])

    def _started(self) -> bool:
        """Every rank of this attempt has built its engine (remembered: the supervisor asks 50 times a second)."""
        if not self._all_started:
            self._all_started = all(self.control.check([f"started/{q}"]) for q in self.procs)
        return self._all_started

    # -- the other nodes: one launcher per node, all on node 0's store --
    def _stopped_elsewhere(self) -> dict | None:
        """Another node's launcher stopped the run (its rank failed, Ctrl-C): what it said, else None."""
        if self.topology.nnodes == 1 or not self.run_store.check(["stopped"]):
            return None
        return json.loads(self.run_store.get("stopped"))

    def _missing_nodes(self) -> list[int]:
        """The nodes whose launcher has not reached the store yet."""
        return [k for k in range(1, self.topology.nnodes) if not self.run_store.check([f"joined/{k}"])]

    def _never_joined(self) -> list[int]:
        """Node 0: the nodes whose launcher has not reached the store after world.timeout_s (none before that);
        every node joined: [] from then on."""
        missing = self._missing_nodes()
        if not missing:
            self._absent = []
        return missing if missing and time.time() - self.t_start > self.recipe.world.timeout_s else []

    def _nodes_named(self, nodes: list[int]) -> str:
        """node 1 (ranks 2-3), node 2 (ranks 4-5)"""
        n = self.recipe.world.nproc
        return ", ".join(f"node {k} (rank{'s' if n > 1 else ''} {k * n}{f'-{k * n + n - 1}' if n > 1 else ''})"
                         for k in nodes)

    def _absent_line(self, nodes: list[int]) -> str:
        who = self._nodes_named(nodes)
        which = str(nodes[0]) if len(nodes) == 1 else "K"
        return (f"error: {who} never joined the rendezvous at {self.address} within world.timeout_s="
                f"{self.recipe.world.timeout_s:g}s; start `dtk train` there with --nnodes {self.topology.nnodes} "
                f"--node-rank {which} --rdzv-endpoint {self.address}, and check that it can reach this host; the run "
                f"is stopped.")

    def _ranks_of(self, node: int) -> list[int]:
        """The ranks `node` runs now: its own, or (in place, checkpoint) what node 0's placement says."""
        n = self.recipe.world.nproc
        return self.view.hosted(node) if self.view is not self else list(range(node * n, node * n + n))

    def _node_active(self, node: int) -> bool:
        """Some rank that `node` runs has not finished (a node whose ranks are all done is not watched)."""
        return any(not self._finished(r) for r in self._ranks_of(node))

    def _peer_gone_unknown(self) -> bool:
        """Ranks recover while no failure is announced: their collectives to a peer broke, and no death explains it
        (a lost host's ranks cannot be reported dead)."""
        return self.hangs.recovering() and not self.control.check([f"gen{self.generation}/failure"])

    def _fence(self, said: str) -> int:
        """Node 0 took this node for lost (it did not hear it for a while) and gives its ranks to other nodes: stop
        them, so that no rank runs twice, and end without stopping the run."""
        self.stop_all(grace_s=0.0)
        self._fenced = True
        self.messages.append(f"error: {said}; this node's ranks are stopped (node 0 recovers them elsewhere).")
        return 1

    def _stop_for_lost_nodes(self, nodes: list[int]) -> int:
        who = self._nodes_named(nodes)
        silent = max(self.node_watch.lost[k] for k in nodes)
        t_detect = time.time()
        records = [describe_failure(self, rank=q, code=None, t_detect=t_detect) for k in nodes for q in self._ranks_of(k)]
        self._stop(records, f"error: {who} went silent (its launcher was not heard for {silent:.1f}s: the host is lost "
                            f"or cut off); the run is stopped; resilience.mode=inplace or checkpoint carries on with "
                            f"its ranks on the other hosts.")
        return 1

    def _follow_stop(self, stop: dict) -> int:
        self.stop_all()
        self.remote_failures = stop["failures"]  # figured by their node already
        other = stop["node"]
        self.messages.append(f"error: node {other} stopped the run, so this node's ranks are stopped; node {other} said:")
        self.messages += [f"  {line}" for line in stop["messages"]]
        return 1

    def _leave(self, code: int) -> None:
        """At the end of a multi-node run: a failed node tells the others to stop; every node says it has left, and
        node 0 waits (a while) for the others, so that none loses the store while it still reports."""
        node = self.topology.node_rank
        try:
            if code != 0 and not self._fenced and not self.run_store.check(["stopped"]):
                self.run_store.set("stopped", json.dumps({"node": node, "code": code, "messages": self.messages,
                                                          "failures": self.failures}))
            self.run_store.set(f"left/{node}", str(code))
            deadline = time.monotonic() + LEAVE_WAIT_S
            while node == 0 and time.monotonic() < deadline:
                gone = set(self._absent or []) | set(self.node_watch.lost)
                if all(self.run_store.check([f"left/{k}"]) for k in range(1, self.topology.nnodes) if k not in gone):
                    break
                time.sleep(0.05)
        except dist_error():
            pass  # node 0 has gone already: nobody is left to tell

    def _supervise(self, progress) -> int:
        next_random, next_progress, next_remote = 0, 0.0, 0.0
        while True:
            if self._sigterm:
                return self._preempt()
            if time.monotonic() >= next_progress:  # the ranks need the CPU more than the progress line does
                progress.update()
                next_progress = time.monotonic() + 0.2
                if stop := self._stopped_elsewhere():
                    return self._follow_stop(stop)
                if self._absent is None and (absent := self._never_joined()):
                    self._absent = absent
                    self._stop([], self._absent_line(absent))
                    return 1
            if self._started() and self._resumed_at is None:
                self._resumed_at = time.time()  # training (re)started: random faults may land again
            if self.t_train is None and self._started():
                self.t_train = time.time()  # random faults are drawn in training time, not start-up time
            now = time.time() - (self.t_train or float("inf"))
            while next_random < len(self.fault_schedule) and self.fault_schedule[next_random][0] <= now:
                due, rank = self.fault_schedule[next_random]
                if self._resumed_at is None or self.t_train + due < self._resumed_at:
                    # it came while the run was recovering: there was no running rank for it to hit
                    append_event(self.run_dir, {"event": "random fault dropped", "rank": rank, "due_s": due,
                                                "why": "it came during a recovery"})
                else:
                    self.deliver(faults.Fault(kind=self.schedule_kind, rank=rank, id=f"mtbf{next_random}"))
                next_random += 1
            running = False
            for rank, proc in list(self.procs.items()):
                code = proc.poll()
                if code is None:
                    running = True
                elif code != 0 and not self._finished(rank):
                    if self.reporter is not None:  # node 0 recovers it: report it (below), keep waiting
                        death = {"code": code, "detected_at": time.time()}
                        if rank in self.hangs.hung:  # node 0 may not have seen it stall: say it was found hung here
                            death["hang_detected_at"] = self.hangs.hung[rank]
                        self.reported_dead.setdefault(rank, death)
                        running = True
                        continue
                    if not self._handle_failure(sorted(r for r in self.view.dead() if not self._finished(r))):
                        return 1
                    running = True
                    break  # the set of processes may have changed
                elif code != 0:
                    log.warning("rank %d finished its steps, then exited with %s (teardown); run kept", rank,
                                signal_name(code))
            if self.node_beat is not None and (said := self.node_beat.beat()):
                return self._fence(said)
            if self.node_watch is not None and (silent := self.node_watch.silent(suspect=self._peer_gone_unknown,
                                                                                 active=self._node_active)):
                if self.view is self:  # resilience.mode=none: nothing takes the lost ranks
                    return self._stop_for_lost_nodes(silent)
                self.view.fence_lost()  # a node only cut off for a while must not keep its ranks
                next_remote = 0.0  # their ranks are dead now (Coordinator.dead): recovered below
            if self.reporter is not None:
                if restart := self.reporter.restart_due():
                    self._follow_restart(*restart)
                    continue
                self.reporter.publish(self.reported_dead)
                self.reporter.serve(self._replace_for_node0, self.reported_dead)
            elif self.view is not self and time.monotonic() >= next_remote:
                next_remote = time.monotonic() + 0.1
                remote = [r for r in [*self.view.remote_dead(), *self.view.on_lost_nodes()] if not self._finished(r)]
                if remote:
                    if not self._handle_failure(sorted(set(remote) | {r for r in self.dead() if not self._finished(r)})):
                        return 1
                    continue
            if not running:
                progress.update()
                return 0
            if self._started():
                # every node reads every rank's beat: ranks waiting on a hung peer of another node are not hung
                for rank in self.hangs.check(self.control, list(range(self.world))):
                    if rank in self.procs:
                        self.procs[rank].kill()  # a hung rank is removed; its death is then handled as any other
            time.sleep(POLL_SECONDS)

    def _handle_failure(self, ranks: list[int]) -> bool:
        """Ranks died (usually one). Returns True when the run goes on (recovered), False when it stops."""
        t_detect = time.time()
        r = self.recipe.resilience
        records = [describe_failure(self, rank=q, code=self._exit_code(q), t_detect=t_detect) for q in ranks]
        host_down = {f["node_lost"]: f["fault_time"] for f in records
                     if f.get("node_lost") is not None and f["fault_time"]}
        for f in records:  # the ranks of a host killed on purpose died when it was killed
            if f["fault_time"] is None and f.get("node_lost") in host_down:
                f["fault_time"] = host_down[f["node_lost"]]
        what = " and ".join(f"rank {f['rank']} failed ({f['fault']})" for f in records)
        started = self._started()
        # progress that a recovery keeps: committed steps in place, the latest checkpoint for a restart
        from dtk.resilience import checkpoint

        kept = (checkpoint.latest(self.run_dir) or (0, None))[0] if r.mode == "checkpoint" else records[0]["committed"]
        self.storm.failed(committed=kept, t_detect=t_detect)
        stop = None
        if r.mode == "none":
            stop = f"error: {what}; the run is stopped."
        elif len(self.failures) + len(records) > r.max_failures:
            stop = f"error: {what} (resilience.max_failures={r.max_failures} reached); the run is stopped."
        elif not started:
            # before every rank has started, the others are still in their first rendezvous: nothing to keep
            stop = f"error: {what} before every rank started; the run is stopped."
            if self._absent is None and (absent := self._missing_nodes()):
                self._absent = absent  # the rendezvous timed out because a node never came: say which
                stop = self._absent_line(absent)
        elif verdict := self.storm.verdict(self.failures):
            stop = f"error: {verdict}."
        if stop is not None:
            return self._stop(records, stop)
        if r.mode == "checkpoint":
            return self._restart(records, t_detect=t_detect, action="restarted from checkpoint")
        try:
            figures = recover_in_place(self.view, failed=set(ranks), t_detect=t_detect)
        except RecoveryFailed as e:
            append_event(self.run_dir, {"event": "in-place recovery failed", "ranks": ranks, "why": str(e)})
            if self.recipe.checkpoint.every:
                return self._restart(records, t_detect=t_detect,
                                     action=f"in-place recovery failed ({e}); restarted from checkpoint")
            return self._stop(records, f"error: {what}, and in-place recovery failed: {e}; the run is "
                                       f"stopped (set checkpoint.every to fall back on a checkpoint).")
        for extra in sorted(set(figures["lost_ranks"]) - set(ranks)):  # lost while recovering
            records.append({"rank": extra, "fault": "failed during recovery", "exit": "-", "attempt": self.attempt,
                            "generation": self.generation, "detected_at": t_detect, "step": records[0]["step"],
                            "committed": records[0]["committed"], "fault_time": None})
        for f in records:
            f.update(figures)
            self.failures.append(f)
            append_event(self.run_dir, {"event": "failure", **f, "action": "recovered in place"})
        self.hangs.reset()  # the replacement's heartbeats start afresh
        self._resumed_at = time.time()
        if self.shadows:
            for sid in self.shadows.replenish():  # in the background: the run never waits for a shadow
                log.info("shadow %d started to replace the one promoted", sid)
        return True

    def _follow_restart(self, attempt: int, hosted: list[int]) -> None:
        """Node k > 0: node 0 restarted the run from a checkpoint: stop this node's ranks, start those it runs now."""
        self.stop_all(grace_s=0.0)
        self.reported_dead.clear()
        self.reporter.attempt = attempt
        self.hosted = hosted
        self.start_attempt(attempt)
        append_event(self.run_dir, {"event": "restart followed", "node": self.topology.node_rank, "attempt": attempt,
                                    "ranks": hosted})

    def _restart(self, records: list[dict], *, t_detect: float, action: str) -> bool:
        restart = restart_from_checkpoint(self, t_detect=t_detect)
        self._resumed_at = None  # set again once every rank has started
        for f in records:
            f.update(restart)
            self.failures.append(f)
            append_event(self.run_dir, {"event": "failure", **f, "action": action})
        return True

    def _stop(self, records: list[dict], message: str) -> bool:
        self.stop_all()
        for f in records:
            self.failures.append(f)
            append_event(self.run_dir, {"event": "failure", **f, "action": "stopped", "why": message})
        self.messages.append(message)
        for f in records:
            if f.get("node_lost") is not None:
                continue  # its log is on the lost host
            log_path = self.run_dir / "logs" / f"rank{f['rank']}.log"
            self.messages.append(f"  last lines of {log_path}:")
            self.messages += [f"    {line}" for line in tail(log_path)]
        return False


def _rank_preexec() -> None:
    """In a rank's process before exec: die with the launcher (Linux), ignore Ctrl-C (the launcher handles it for
    the whole run: it stops the ranks and says where the run stands), and block SIGTERM (its mask is kept across
    exec; dtk.worker's watch thread tells the launcher's from another's)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # taken by one thread of the rank (dtk.worker)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def launch(recipe: recipes.Recipe, *, recipe_path: str | None, topology: Topology | None = None,
           show_progress: bool = True, inject: list | None = None, fault_schedule: list | None = None,
           schedule_kind: str = "kill", live_control: bool = True) -> tuple[int, Path]:
    topology = topology or Topology()
    recipes.check_launch(recipe, nnodes=topology.nnodes)
    if recipe.output.dir and recipe.checkpoint.resume == "auto" and topology.nnodes == 1:
        from dtk.resilience.checkpoint import resume_line

        # ranks skip the same damaged checkpoints: say which, and why (several nodes: check_shared, in run)
        if line := resume_line(recipe.output.dir):
            print(f"note: {line}", file=sys.stderr)
    run_dir = prepare_run_dir(recipe, recipe_path)
    launcher = Launcher(recipe=recipe, run_dir=run_dir, topology=topology, show_progress=show_progress,
                        faults=list(inject or []), fault_schedule=list(fault_schedule or []), schedule_kind=schedule_kind,
                        live_control=live_control)
    return launcher.run(), run_dir
