"""The launcher of one node: it hosts the run's TCPStore (node 0), so the store outlives any rank, and its `Host`
starts, watches and stops this node's ranks and shadows. `launch` joins the host to the supervisor
(dtk.resilience.supervisor: the watch loop and the failure policy) and to this node's role among the run's nodes
(dtk.resilience.roles), shows one progress line, and writes summary.json.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch.distributed as dist

from dtk import recipe as recipes
from dtk.metrics import append_event
from dtk.netif import backend_env, own_addresses
from dtk.prestart import Prestarted, ds_accelerator, rank_preexec
from dtk.report import ProgressLine, write_summary
from dtk.resilience import faults
from dtk.resilience import protocol as keys
from dtk.resilience.checkpoint import DISK_FULL, check_shared, disk_full_line, disk_is_full, resume_line
from dtk.resilience.failures import finalize_failures
from dtk.resilience.live import LiveControl
from dtk.resilience.recovery import RunState
from dtk.resilience.roles import LocalView, absent_line, node_role
from dtk.resilience.shadow import ShadowPool
from dtk.resilience.supervisor import NodeRole, Supervisor
from dtk.rendezvous import Topology, open_store
from dtk.rundir import prepare_run_dir
from dtk.testbed.run import train_on_testbed

SHADOW_IDS_PER_NODE = 1000


@dataclass(kw_only=True)
class Host:
    """This node's processes: its ranks in the current attempt and its shadows (dtk.resilience.supervisor.Host)."""

    recipe: recipes.Recipe
    run_dir: Path
    topology: Topology
    address: str
    """host:port of the run's store, for the ranks."""
    world: int
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    shadows: ShadowPool | None = None
    attempt: int = 0
    prestarted: Prestarted | None = None
    """The first attempt's ranks, started importing before this launcher imported torch (dtk.prestart)."""

    def __post_init__(self) -> None:
        self.first_rank = self.topology.node_rank * self.recipe.world.nproc
        self.hosted = list(range(self.first_rank, self.first_rank + self.recipe.world.nproc))
        """The ranks this node starts in an attempt: its own, plus a lost node's after a checkpoint restart."""
        node = self.topology.node_rank
        # one run folder for every node: node 0 owns ranks.json, the others write their own
        self.pids_name = "ranks.json" if node == 0 else f"ranks-node{node}.json"

    def _env(self, rank: int, join_generation: int | None, shadow_id: int | None = None) -> dict:
        env = dict(os.environ)
        env.update(RANK=str(rank), WORLD_SIZE=str(self.world), LOCAL_RANK=str(rank - self.first_rank),
                   LOCAL_WORLD_SIZE=str(self.recipe.world.nproc), DTK_RUN_DIR=str(self.run_dir),
                   DTK_STORE=self.address, OMP_NUM_THREADS=str(self.recipe.world.threads_per_rank),
                   DTK_ATTEMPT=str(self.attempt), DTK_SPAWNED_AT=repr(time.time()), PYTHONUNBUFFERED="1")
        # world.interface: GLOO/NCCL_SOCKET_IFNAME (picked once, printed once)
        env.update(backend_env(self.recipe.world.interface, endpoint=self.address, multi_node=self.topology.nnodes > 1))
        env["DS_ACCELERATOR"] = ds_accelerator(self.recipe.world.device, env)
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
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=rank_preexec)
        finally:
            logf.close()

    def spawn(self, rank: int, join_generation: int | None = None) -> subprocess.Popen:
        env, log_name = self._env(rank, join_generation), f"rank{rank}.log"
        proc = None
        if self.prestarted is not None and self.attempt == 0 and join_generation is None:
            proc = self.prestarted.hand_over(env, str(self.run_dir / "logs" / log_name))
        if proc is None:
            proc = self._popen(log_name, env)
        self.procs[rank] = proc
        self._write_pids()
        return proc

    def spawn_shadow(self, shadow_id: int) -> subprocess.Popen:
        proc = self._popen(f"shadow{shadow_id}.log", self._env(self.first_rank, None, shadow_id))
        append_event(self.run_dir, {"event": "shadow started", "shadow": shadow_id, "pid": proc.pid,
                                    "attempt": self.attempt})
        return proc

    def start(self, *, attempt: int, control: dist.Store, hosted: list[int] | None) -> None:
        self.attempt = attempt
        if hosted is not None:
            self.hosted = hosted
        self.procs = {}
        for rank in self.hosted:
            self.spawn(rank)
        if self.shadows is not None:
            self.shadows.stop()
        count = self.recipe.resilience.shadows
        if self.recipe.resilience.mode == "inplace" and count:
            # shadow ids are keys in the run's one store: each node numbers its own from node_rank * 1000
            self.shadows = ShadowPool(count=count, spawn=self.spawn_shadow, control=control,
                                      started=SHADOW_IDS_PER_NODE * self.topology.node_rank)
            self.shadows.start()

    def ranks(self) -> list[int]:
        return sorted(self.procs)

    def exit_codes(self) -> dict[int, int | None]:
        return {r: p.poll() for r, p in list(self.procs.items())}

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

    def replenish_shadows(self) -> list[int]:
        return self.shadows.replenish() if self.shadows else []

    def kill(self, rank: int) -> None:
        self.procs[rank].kill()

    def _write_pids(self) -> None:
        pids = {str(r): p.pid for r, p in self.procs.items()}
        (self.run_dir / self.pids_name).write_text(json.dumps({"launcher": os.getpid(), "ranks": pids}))

    def stop_all(self, grace_s: float = 3.0) -> None:
        """SIGTERM every rank, SIGKILL what is left after grace_s (0: SIGKILL at once). Shadows stay (see close)."""
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

    def close(self) -> dict:
        """Stop the shadows; what they were, for summary.json."""
        if self.shadows is None:
            return {"count": 0, "promotions": 0, "rss_bytes": []}
        summary = self.shadows.summary()
        self.shadows.stop()
        return summary


def run_here(recipe: recipes.Recipe, *, recipe_path: str | None, testbed: int, inject: list, show_progress: bool,
             topology: Topology | None = None, fault_schedule: list | None = None, schedule_kind: str = "kill",
             live_control: bool = True, prestarted: Prestarted | None = None) -> tuple[int, Path]:
    """Run the recipe on this machine; (exit code, run folder). With `testbed` hosts: on an emulated network of that
    many (dtk.testbed.run, whose driver starts one launcher per host, serves `dtk inject-failure --run` and sets the
    topology; it takes no random faults), else as this node's launcher (`launch`)."""
    if testbed:
        return train_on_testbed(recipe, recipe_path=recipe_path, hosts=testbed, faults=inject,
                                show_progress=show_progress)
    return launch(recipe, recipe_path=recipe_path, topology=topology, show_progress=show_progress, inject=inject,
                  fault_schedule=fault_schedule, schedule_kind=schedule_kind, live_control=live_control,
                  prestarted=prestarted)


def launch(recipe: recipes.Recipe, *, recipe_path: str | None, topology: Topology | None = None,
           show_progress: bool = True, inject: list | None = None, fault_schedule: list | None = None,
           schedule_kind: str = "kill", live_control: bool = True,
           prestarted: Prestarted | None = None) -> tuple[int, Path]:
    """Run this node's share of the recipe; (exit code, run folder). `inject`: faults to deliver; `fault_schedule`:
    (seconds of training, rank) of random faults of `schedule_kind` (--mtbf); `live_control`: serve
    `dtk inject-failure --run` (node 0 only; off where a test bed's driver serves it for the run); `prestarted`:
    this node's first ranks, already importing (dtk.prestart; the launch ends those it does not use)."""
    topology = topology or Topology()
    recipes.check_launch(recipe, nnodes=topology.nnodes)
    if recipe.output.dir and recipe.checkpoint.resume == "auto" and topology.nnodes == 1:
        # ranks skip the same damaged checkpoints: say which, and why (several nodes: check_shared, below)
        if line := resume_line(recipe.output.dir):
            print(f"note: {line}", file=sys.stderr)
    run_dir = prepare_run_dir(recipe, recipe_path)
    node, world = topology.node_rank, recipe.world.nproc * topology.nnodes
    store, address = open_store(topology)
    run_store = keys.run_store(store)
    # multi-node resume: every host reads node 0's checkpoint
    check_shared(store, run_dir=run_dir, node_rank=node, nnodes=topology.nnodes, resume=recipe.checkpoint.resume,
                 timeout_s=recipe.world.timeout_s)
    state = RunState()
    host = Host(recipe=recipe, run_dir=run_dir, topology=topology, address=address, world=world,
                prestarted=prestarted)
    local = LocalView(processes=host, state=state, run_dir=run_dir)
    role = node_role(nnodes=topology.nnodes, node=node, mode=recipe.resilience.mode, nproc=recipe.world.nproc,
                     local=local, state=state, run_store=run_store)
    # node 0 maps the address a survivor's broken connection names to the node lost, and calls its line (several
    # nodes)
    addresses = own_addresses() if topology.nnodes > 1 else []
    run_store.set(keys.joined(node), json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                 "addresses": addresses, "line": role.line_port}))
    board = faults.FaultBoard(run_store=run_store, run_dir=run_dir, world=world, nnodes=topology.nnodes,
                              schedule=list(fault_schedule or []), schedule_kind=schedule_kind,
                              steps=recipe.training.steps, mode=recipe.resilience.mode,
                              every=recipe.checkpoint.every)
    for f in inject or []:
        board.deliver(f)
    live = LiveControl(run_dir, board.live) if live_control and not node else None
    supervisor = Supervisor(recipe=recipe, run_dir=run_dir, host=host, role=role, board=board, state=state,
                            store=store, world=world, node=node,
                            absent_line=partial(absent_line, nproc=recipe.world.nproc, nnodes=topology.nnodes,
                                                timeout_s=recipe.world.timeout_s, address=address))
    code, disk_full = 1, False  # what summary.json says if the watch itself fails (a bug: its traceback follows)
    on_main = threading.current_thread() is threading.main_thread()
    if on_main:
        signal.signal(signal.SIGTERM, lambda signum, frame: setattr(supervisor, "sigterm", True))
    try:
        supervisor.start_attempt(0)
        if prestarted is not None:
            prestarted.close()
        code = _watch(supervisor, host=host, node=node, show_progress=show_progress)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        host.stop_all()
        disk_full = True
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if live is not None:
            live.close()
        code = _finish(supervisor, host=host, role=role, code=code, store=store, topology=topology,
                       disk_full=disk_full)
    return code, run_dir


def _watch(supervisor: Supervisor, *, host: Host, node: int, show_progress: bool) -> int:
    """The supervisor's watch loop under a progress line; Ctrl-C and (node k > 0) a lost store end it with a line."""
    progress = ProgressLine(supervisor.run_dir, total=supervisor.recipe.training.steps, enabled=show_progress)
    try:
        with progress:
            return supervisor.watch(progress)
    except KeyboardInterrupt:
        host.stop_all()
        append_event(supervisor.run_dir, {"event": "interrupted", "by": "the user (Ctrl-C)"})
        return 130
    except dist.DistError as e:
        if not node:
            raise  # node 0 hosts the store: losing it is a bug
        host.stop_all()
        supervisor.messages.append(f"error: node {node} lost the run's store on node 0 ({e!s:.80}); its ranks are "
                                   "stopped.")
        return 1


def _finish(supervisor: Supervisor, *, host: Host, role: NodeRole, code: int, store: dist.Store,
            topology: Topology, disk_full: bool) -> int:
    """Give every failure its figures, write this node's summary, say why the run stopped and (several nodes)
    leave; returns the exit code (a full disk fails the run)."""
    shadows = host.close()
    run_dir, node, world = supervisor.run_dir, topology.node_rank, supervisor.world
    try:
        finalize_failures(supervisor.failures, run_dir=run_dir, store=store, world=world)
        failures = [f.to_dict() for f in supervisor.failures + supervisor.remote_failures]
        write_summary(run_dir, wall_seconds=time.time() - supervisor.t_start, failures=failures, exit_code=code,
                      shadows=shadows, name="summary.json" if node == 0 else f"summary-node{node}.json",
                      world_size=world, faults_fired=supervisor.board.fired_ids(),
                      resilience={"mode": supervisor.recipe.resilience.mode, **supervisor.hangs.describe()})
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        code, disk_full = code or 1, True
    if disk_full or (code and (any(DISK_FULL in line for line in supervisor.messages) or disk_is_full(run_dir))):
        supervisor.messages = [disk_full_line(run_dir)]  # a rank's traceback would only repeat it
    for line in supervisor.messages:
        print(line, file=sys.stderr)
    if topology.nnodes > 1:
        try:
            role.leave(code, fenced=supervisor.fenced, messages=supervisor.messages, failures=supervisor.failures)
        except dist.DistError:
            pass  # node 0 has gone already: nobody is left to tell
    return code
