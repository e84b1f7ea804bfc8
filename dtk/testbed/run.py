"""`dtk train --testbed H`: a run across H emulated hosts. One launcher per host runs inside that host's namespace
(node 0's hosts the store); this driver stays in the root namespace, applies congestion faults at their step, serves
`dtk inject-failure --run`, and always tears the hosts down (on success, failure, Ctrl-C and SIGTERM)."""
from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from dtk import recipe as recipes
from dtk.errors import DtkError
from dtk.metrics import append_event
from dtk.parentdeath import die_with_parent
from dtk.resilience import faults as fl
from dtk.resilience.failures import FailureRecord
from dtk.resilience import protocol as keys
from dtk.testbed import shape
from dtk.testbed.net import Testbed

if TYPE_CHECKING:  # torch is imported once the run starts
    from torch.distributed import Store

STORE_PORT = 29400
"""Node 0's store port; each test bed is a fresh namespace, so it is always free there."""
POLL_SECONDS = 0.05
LEAVE_GRACE_S = 30.0
"""After node 0's launcher has ended, how long the others get to end on their own before they are killed."""
INTERRUPT_GRACE_S = 20.0


class _Terminated(Exception):
    """SIGTERM reached the driver: stop the run as Ctrl-C would, then tear down."""


def _launcher_preexec() -> None:
    """A launcher gets its own process group (the driver forwards one Ctrl-C to it, never two) and dies with the
    driver; its ranks die with it (they carry the same parent-death signal)."""
    os.setpgrp()
    die_with_parent()


class TestbedRun:
    """The driver of one run on a test bed; `run()` returns node 0's exit code (1 if another node failed)."""

    __test__ = False

    def __init__(self, recipe: recipes.Recipe, *, run_dir: Path, hosts: int, faults: list, show_progress: bool):
        self.recipe, self.run_dir, self.hosts, self.show_progress = recipe, run_dir, hosts, show_progress
        self.rank_faults = [f for f in faults if isinstance(f, fl.Fault)]
        congestion = [c for c in faults if isinstance(c, shape.Congestion)]
        self.at_once = [c for c in congestion if c.step is None]
        # a congestion due at a step is a fault of rank 0's: at that step it waits until the driver has shaped
        self.unannounced = {f"congest{i}": c for i, c in enumerate(congestion) if c.step is not None}
        self.armed: dict[str, shape.Congestion] = {}
        self.world = recipe.world.nproc * hosts
        self.bed = Testbed(n=hosts)
        self.procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()  # the live channel's thread and the main loop both shape and announce
        self._store: Store | None = None

    # -- the launchers --
    def _spawn(self, node: int) -> subprocess.Popen:
        prefix, env = self.bed.spawn_prefix(node)
        argv = [*prefix, sys.executable, "-m", "dtk.cli", "train", str(self.run_dir / "recipe.yaml"),
                "--nnodes", str(self.hosts), "--node-rank", str(node),
                "--rdzv-endpoint", f"{self.bed.ip(0)}:{STORE_PORT}", "--no-live-control"]
        if node or not self.show_progress:
            argv.append("--no-progress")
        out = None  # the user sees node 0's progress line and result; the others' output goes to the run's logs
        if node == 0:  # node 0 announces the ranks' faults to every rank through the store
            argv += [a for f in self.rank_faults for a in ("--fault", f.spec())]
        else:
            out = open(self.run_dir / "logs" / f"launcher{node}.log", "ab")
        try:
            # the store warns of every client whose hostname a namespace cannot resolve: noise for the user
            env = {"TORCH_CPP_LOG_LEVEL": "ERROR", **os.environ, **env}
            return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT if out else None, preexec_fn=_launcher_preexec)
        finally:
            if out is not None:
                out.close()

    def _run_store(self, timeout_s: float = 60.0):
        """A client of node 0's store, through the root namespace's link to the bridge (connects on first use;
        raises torch's DistError when node 0's store does not answer within timeout_s)."""
        if self._store is None:
            import torch.distributed as dist

            store = dist.TCPStore(self.bed.ip(0), STORE_PORT, is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
            store.set_timeout(datetime.timedelta(seconds=60))
            self._store = keys.run_store(store)
        return self._store

    def _store_listening(self) -> bool:
        try:
            socket.create_connection((self.bed.ip(0), STORE_PORT), timeout=0.2).close()
        except OSError:
            return False
        return True

    # -- congestion --
    def _congest(self, c: shape.Congestion, *, how: str, at_step: int | None = None) -> None:
        t0 = time.time()
        shape.add(self.bed, c)
        append_event(self.run_dir, {"event": "congestion", "spec": c.spec(), "step": at_step, "how": how,
                                    "apply_s": time.time() - t0, "in_force": [x.spec() for x in self.bed.shaping]})

    def _congest_due(self) -> None:
        """Announce the congestion faults once node 0's store is up; shape each link once rank 0 reached its step."""
        with self._lock:
            if self.unannounced:
                if self._store is None and not self._store_listening():
                    return  # node 0's launcher is still starting
                store = self._run_store()
                for fault_id, c in list(self.unannounced.items()):
                    fl.announce(store, fl.Fault(kind="congest", rank=0, step=c.step, id=fault_id))
                    self.armed[fault_id] = self.unannounced.pop(fault_id)
            for fault_id, c in list(self.armed.items()):
                store = self._run_store()
                if store.check([keys.fired(fault_id)]):
                    fired = json.loads(store.get(keys.fired(fault_id)))
                    self._congest(c, how="at its step", at_step=fired["at_step"])
                    store.set(keys.applied(fault_id), "1")
                    del self.armed[fault_id]

    def live_faults(self, specs: list[str], ids: list[str]) -> list[str]:
        """From `dtk inject-failure --run DIR` (dtk.resilience.live): congestion is shaped here, rank faults are
        announced in the store."""
        parsed = [fl.parse(s, world=self.world, fault_id=i, flag="fault", hosts=self.hosts) for s, i in zip(specs, ids)]
        for fault_id, f in zip(ids, parsed):
            if isinstance(f, shape.Congestion) and f.step is None:
                with self._lock:
                    self._congest(f, how="live")
            elif isinstance(f, shape.Congestion):
                with self._lock:
                    self.unannounced[fault_id] = f
            else:
                with self._lock:
                    fl.announce(self._run_store(), f)
        names = [f.as_fault() if isinstance(f, shape.Congestion) else f.spec() for f in parsed]
        append_event(self.run_dir, {"event": "faults scheduled", "faults": names, "by": "test bed driver"})
        return names

    # -- the run --
    def run(self) -> int:
        from dtk.resilience.live import LiveControl

        previous = signal.signal(signal.SIGTERM, _raise_terminated)
        live = None
        try:
            self.bed.up()
            for c in self.at_once:  # in force before any rank starts
                self._congest(c, how="at once")
            append_event(self.run_dir, {"event": "test bed up", "hosts": self.hosts, "tag": self.bed.tag,
                                        "ips": [self.bed.ip(i) for i in range(self.hosts)],
                                        "store": f"{self.bed.ip(0)}:{STORE_PORT}",
                                        "ranks_per_host": self.recipe.world.nproc})
            self.procs = [self._spawn(node) for node in range(self.hosts)]
            live = LiveControl(self.run_dir, self.live_faults)
            return self._watch()
        except (KeyboardInterrupt, _Terminated):
            self._interrupt()
            return 130
        finally:
            if live is not None:
                live.close()
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            self.bed.down()
            signal.signal(signal.SIGTERM, previous)

    def _watch(self) -> int:
        # a node whose launcher ends early (a lost host, a crash) is node 0's to notice: it stops hearing its beat
        while self.procs[0].poll() is None:
            self._congest_due()
            time.sleep(POLL_SECONDS)
        deadline = time.monotonic() + LEAVE_GRACE_S
        while any(p.poll() is None for p in self.procs[1:]) and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        codes = [p.poll() for p in self.procs]
        assert codes[0] is not None  # the loop above ran until node 0's launcher exited
        append_event(self.run_dir, {"event": "launchers ended", "exit_codes": codes})
        summary = self.run_dir / "summary.json"
        if not summary.exists():
            print(f"failed: node 0's launcher exited with {codes[0]} and wrote no summary; its output is above, the "
                  f"other nodes' in {self.run_dir / 'logs'}/launcher<N>.log", file=sys.stderr)
            return codes[0] or 1
        # a node lost mid-run and recovered in place by node 0 ended badly, yet the run did not
        failures = map(FailureRecord.from_dict, json.loads(summary.read_text()).get("failures", []))
        lost = {f.node_lost for f in failures if f.node_lost is not None}
        others_ok = all(c == 0 or node in lost for node, c in enumerate(codes[1:], start=1))
        return codes[0] if codes[0] != 0 or others_ok else 1

    def _interrupt(self) -> None:
        """Ctrl-C or SIGTERM: one SIGINT to each launcher (each stops its ranks, node 0 writes the summary), then
        wait for them, a while."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            try:
                time.sleep(POLL_SECONDS)
            except KeyboardInterrupt:  # a second Ctrl-C: stop waiting, kill (the finally block does)
                break


def _raise_terminated(signum, frame) -> None:
    raise _Terminated()


def check_steps(faults: list, *, steps: int) -> None:
    """A congestion due at a step the run never reaches would silently not happen: refuse it."""
    bad = [c for c in faults if isinstance(c, shape.Congestion) and c.step is not None and c.step >= steps]
    if bad:
        raise DtkError(f"--fault: got step={bad[0].step} in {bad[0].as_fault()!r}; accepted: a step below "
                       f"training.steps ({steps})")


def train_on_testbed(recipe: recipes.Recipe, *, recipe_path: str | None, hosts: int, faults: list,
                     show_progress: bool = True) -> tuple[int, Path]:
    """Run `recipe` with world.nproc ranks on each of `hosts` emulated hosts; returns (exit code, run folder)."""
    from dtk.rundir import prepare_run_dir

    check_steps(faults, steps=recipe.training.steps)
    recipes.check_launch(recipe, nnodes=hosts)
    run_dir = prepare_run_dir(recipe, recipe_path)  # node 0's launcher writes the same recipe.yaml again
    return TestbedRun(recipe, run_dir=run_dir, hosts=hosts, faults=faults, show_progress=show_progress).run(), run_dir
