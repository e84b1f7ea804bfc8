"""A rank's line to its launcher, over the run's TCPStore: heartbeats, failure notices, faults, reports, plans.

A watcher thread (its own store connection) polls for the launcher's failure notice of the current generation
and releases the seam's blocked collectives at once, so no rank waits for a collective timeout. Keys live under
`dtk/a<attempt>/` (one attempt = one set of rank processes; a checkpoint restart starts a new attempt) and
`dtk/run/` (what holds across attempts: faults and their firing).
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
from typing import Callable

import torch.distributed as dist

from dtk.comm.seam import Seam
from dtk.resilience import protocol as keys

log = logging.getLogger(__name__)
POLL_SECONDS = 0.05
FENCED_EXIT = 76
"""Exit code of a rank whose node was taken for lost: another process holds its rank now."""


def connect(address: str, *, timeout_s: float = 300) -> dist.Store:
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


class Control:
    def __init__(self, *, address: str, rank: int, attempt: int):
        self.rank = rank
        self.token = f"{socket.gethostname()}:{os.getpid()}"
        """This process, in its beats: node 0 fences it by this name when its node is taken for lost."""
        self.store = keys.attempt_store(connect(address), attempt)
        self.run_store = keys.run_store(connect(address))
        self._watch_store = keys.attempt_store(connect(address), attempt)
        self._watch_run = keys.run_store(connect(address))
        self.step = 0
        self._phase = "train"
        self._progress_at = time.monotonic()
        """When the main thread last moved on (a new step or phase): a beat says how long ago, by this clock."""
        self.step_seconds = 0.0
        """The last committed step's duration: the launcher sizes its hang timeout from it."""
        self.last_plan: dict | None = None
        """The recovery plan this rank last joined by (dtk.resilience.inplace.rejoin)."""
        self.on_faults: Callable[[list[dict]], None] | None = None
        """Called from the watcher thread with newly announced fault specs (a list of dicts) for this rank."""
        self.preempted = False
        """The launcher asked the run to stop and save (it got SIGTERM); seen by the watcher thread."""
        self._stop_at: int | None = None
        self._faults_seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dtk-control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _watch(self) -> None:
        last_beat = 0.0
        posted = -1  # the generation whose broken connection this rank has posted
        while not self._stop.wait(POLL_SECONDS):
            try:
                generation = Seam.generation
                key = keys.failure(generation)
                if Seam.failed_generation != generation and self._watch_store.check([key]):
                    Seam.release(self._watch_store.get(key).decode(), generation=generation)
                if Seam.broken is not None and Seam.broken[0] == generation and posted != generation:
                    line = json.dumps({"rank": self.rank, "peer": Seam.broken[1]}) + "\n"
                    # torch's stubs lack Store.append
                    self._watch_store.append(keys.peer_errors(generation), line)  # type: ignore[attr-defined]
                    posted = generation
                if time.monotonic() - last_beat > keys.BEAT_SECONDS:
                    outstanding = sum(len(g.outstanding) for g in Seam.groups)
                    self._watch_store.set(keys.beat(self.rank), json.dumps(
                        {"step": self.step, "t": time.time(), "outstanding": outstanding, "phase": self.phase,
                         "still_s": round(time.monotonic() - self._progress_at, 3), "step_s": self.step_seconds,
                         "token": self.token}))
                    last_beat = time.monotonic()
                    self._poll_faults()
                    if not self.preempted and self._watch_store.check([keys.PREEMPT]):
                        self.preempted = True
                    if self._watch_store.check([keys.fenced(self.token)]):
                        self._exit_fenced(self._watch_store)
            except Exception:  # the launcher went away: the run is over, the main thread will find out
                return

    def _poll_faults(self) -> None:
        key = keys.faults(self.rank)
        if self.on_faults is None or not self._watch_run.check([key]):
            return
        faults = json.loads(self._watch_run.get(key))
        if len(faults) > self._faults_seen:
            self.on_faults(faults[self._faults_seen:])
            self._faults_seen = len(faults)

    def fence_check(self) -> None:
        """Before acting on a plan: a rank whose node was taken for lost exits (its rank was given to another)."""
        if self.store.check([keys.fenced(self.token)]):
            self._exit_fenced(self.store)

    def _exit_fenced(self, store) -> None:
        log.error("rank %d: %s; exiting", self.rank, store.get(keys.fenced(self.token)).decode())
        logging.shutdown()
        os._exit(FENCED_EXIT)

    def initial_faults(self) -> list[dict]:
        key = keys.faults(self.rank)
        return json.loads(self.run_store.get(key)) if self.run_store.check([key]) else []

    @property
    def phase(self) -> str:
        """What the main thread is doing, for the launcher's hang watch: train, eval, checkpoint and recovery (the
        last three allowed longer)."""
        return self._phase

    @phase.setter
    def phase(self, phase: str) -> None:
        self._phase = phase
        self._progress_at = time.monotonic()

    def beat(self, step: int) -> None:
        if step != self.step:
            self._progress_at = time.monotonic()
        self.step = step

    def mark(self, key: str, payload: dict) -> None:
        """A fact for the launcher (a key of dtk.resilience.protocol: start-up timeline, corruption), under this
        attempt's prefix."""
        self.store.set(key, json.dumps(payload))

    def report(self, generation: int, kind: str, payload: dict) -> None:
        """kind: "failed" (this rank saw generation's failure) or "rejoined" (it runs in generation)."""
        self.store.set(keys.report(generation, kind, self.rank), json.dumps(payload))

    def wait_plan(self, generation: int) -> dict:
        key = keys.plan(generation)
        self.store.wait([key], datetime.timedelta(seconds=600))
        return json.loads(self.store.get(key))

    def generation_failed(self, generation: int) -> bool:
        return self.store.check([keys.failure(generation)])

    def stop_at(self, step: int) -> int | None:
        """Once preempted: the number of committed steps at which every rank stops, agreed through the store. Asked
        at every step boundary (checkpoints on). The first rank whose watcher saw the preempt flag proposes its own
        count + 2; every other rank reads the proposal from the store at its next boundary, not from its own watcher,
        which may be several steps late under load (it polls every BEAT_SECONDS: with a late watcher, a rank ran on
        past the agreed step while its peer saved, and both waited for ever). Why + 2 is exact: ranks run in lockstep
        (every step has a collective that needs every rank), so when the proposer writes at boundary s, a peer may
        have passed boundary s + 1 already (not s + 2, whose step needs the proposer's contribution): it reads the
        proposal at boundary s + 2 at the latest. One store round trip per step (~25 us on one host)."""
        if self._stop_at is None:
            if self.preempted:
                self._stop_at = int(self.store.compare_set(keys.PREEMPT_STOP_AT, "", str(step + 2)).decode())
            elif self.store.check([keys.PREEMPT_STOP_AT]):
                self._stop_at = int(self.store.get(keys.PREEMPT_STOP_AT).decode())
        return self._stop_at

    def finish(self, step: int) -> None:
        self.store.set(keys.done(self.rank), str(step))

    def close(self) -> None:
        self._stop.set()
