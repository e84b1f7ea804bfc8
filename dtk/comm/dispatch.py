"""comm.mode adaptive: runs each collective of a DtkGroup the way the plan says (native, the native op on a
renumbered group, or a dtk p2p algorithm on a worker thread), feeds the monitor, and at step boundaries lets
every rank agree on the next plan (a tiny all-reduce of "probe?" flags, a probe, an all-gather of link rows)."""
from __future__ import annotations

import datetime
import json
import logging
import queue
import threading
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, ReduceScatterOptions, _create_work_from_future

from dtk.comm import algorithms
from dtk.comm.monitor import LinkMonitor
from dtk.comm.planner import NATIVE, PIECE_BYTES, Choice, PlanState, describe
from dtk.comm.seam import Seam

log = logging.getLogger(__name__)

PROBE_EVERY = 50
"""Boundaries between probes while a non-native plan is in force (to see the avoided link recover)."""


class Router:
    """One per DtkGroup in adaptive mode. `route` is called when a collective is issued (same order on every
    rank); `boundary` at a step boundary, by every rank."""

    def __init__(self, *, store, rank: int, size: int, timeout: datetime.timedelta, generation: int):
        self.rank, self.size, self.timeout = rank, size, timeout
        self._store = dist.PrefixStore(f"gen{generation}/dtk-comm", store)
        self.ctl = dist.ProcessGroupGloo(dist.PrefixStore("ctl", self._store), rank, size, timeout)
        self.monitor = LinkMonitor(rank=rank, size=size)
        self.state = PlanState()
        self.groups: dict[tuple, object] = {}
        self.boundaries = 0
        self.last_probe = -1
        self.events: list[dict] = []
        """Plan changes not yet written out (the trainer or the bench writes them to events.jsonl)."""
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    # -- at issue time --
    def route(self, kind: str, native, **a):
        """The callable the seam runs on its inner group: the plan's way, or `native`."""
        choice = self.state.plan.get(kind, NATIVE)
        nbytes = a.pop("nbytes")
        if choice.algo == "native" or nbytes < choice.min_bytes or not _eligible(kind, a):
            return self._timed(kind, nbytes, native)
        if choice.algo == "reordered":
            return _guarded(self._timed(kind, nbytes, lambda g: _reordered(self._group(choice.order), kind,
                                                                           choice.order, a)))
        return _guarded(lambda g: self._submit(lambda: self._leaf(choice, a["tensors"][0])))

    def _timed(self, kind: str, nbytes: int, call):
        def run(g):
            t0 = time.perf_counter()
            work = call(g)
            try:
                work.get_future().add_done_callback(
                    lambda f: self.monitor.observe_native(kind, nbytes, time.perf_counter() - t0))
            except RuntimeError:
                pass  # a work without a future (gloo's _reduce_scatter_base): not timed
            return work
        return run

    def _submit(self, job) -> dist._Work:
        fut: torch.futures.Future = torch.futures.Future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dtk-comm", daemon=True)
            self._thread.start()
        self._jobs.put((job, fut))
        return _create_work_from_future(fut)

    def _loop(self) -> None:
        while True:
            job, fut = self._jobs.get()
            try:
                job()
            except Exception as e:  # the seam turns this into a released step, never into a raise
                fut.set_exception(e)
            else:
                fut.set_result(None)

    def _leaf(self, choice: Choice, t: torch.Tensor) -> None:
        leaders = tuple(g[0] for g in choice.groups)
        sub = self._group(("leaders",) + leaders) if self.rank in leaders else None
        p2p = algorithms.P2P(self.ctl)
        algorithms.hierarchical_all_reduce(
            p2p, t, groups=choice.groups, back=dict(choice.back), chunk_bytes=PIECE_BYTES,
            leader_all_reduce=(lambda x: sub.allreduce([x]).wait()) if sub is not None else None)
        self.monitor.observe_p2p(p2p.timings)

    # -- groups a plan needs, built at the boundary by every member --
    def _group(self, key: tuple):
        return self.groups[key]

    def _build_groups(self, plan: dict[str, Choice]) -> None:
        for choice in plan.values():
            if choice.algo == "reordered" and choice.order not in self.groups:
                name = "order-" + "-".join(map(str, choice.order))
                self.groups[choice.order] = dist.ProcessGroupGloo(
                    dist.PrefixStore(name, self._store), choice.order.index(self.rank), self.size, self.timeout)
            if choice.algo == "leaf":
                leaders = tuple(g[0] for g in choice.groups)
                key = ("leaders",) + leaders
                if self.rank in leaders and key not in self.groups:
                    name = "leaders-" + "-".join(map(str, leaders))
                    self.groups[key] = dist.ProcessGroupGloo(
                        dist.PrefixStore(name, self._store), leaders.index(self.rank), len(leaders), self.timeout)

    # -- at a step boundary --
    def boundary(self, step: int | None = None) -> list[dict]:
        """Every rank calls this at the same point. Probes when some rank asks (a slowed native collective,
        the first boundary, or a periodic recheck of a non-native plan), then decides; returns new events."""
        self.boundaries += 1
        slow = self.monitor.take_slow()
        periodic = self.state.plan != {k: NATIVE for k in self.state.plan} and \
            self.boundaries - self.last_probe >= PROBE_EVERY
        want = torch.tensor([1.0 if (self.last_probe < 0 or slow or periodic) else 0.0])
        _max(self.ctl, want)
        if not want.item():
            return []
        reason = "first boundary" if self.last_probe < 0 else ("native collective slowed" if slow else "recheck")
        self.last_probe = self.boundaries
        t0 = time.perf_counter()
        row = torch.tensor(self.monitor.probe(self.ctl), dtype=torch.float64)
        rows = [torch.empty_like(row) for _ in range(self.size)]
        self.ctl.allgather([rows], [row]).wait()
        probe_s = time.perf_counter() - t0
        raw = [r.tolist() for r in rows]
        before = describe(self.state.plan)
        decision = self.state.update(raw, reason=reason)
        if not decision.changed:
            return []
        self._build_groups(decision.plan)
        event = {"event": "comm_plan", "step": step, "time": time.time(), "rank": self.rank,
                 "changed": decision.changed, "before": {k: before[k] for k in decision.changed},
                 "after": {k: describe(decision.plan)[k] for k in decision.changed},
                 "probe_seconds": round(probe_s, 4), "slow_collectives": slow[:4], **decision.evidence}
        (log.warning if self.rank == 0 else log.info)("comm plan changed at step %s: %s (congested links: %s)", step,
                    json.dumps(event["after"]), [c["link"] for c in event["congested_links"]])
        self.events.append(event)
        return [event]


def _guarded(call):
    """An error while issuing a dtk route becomes a failed work (the seam releases the step), never a raise."""
    def run(g):
        try:
            return call(g)
        except Exception as e:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_exception(e)
            return _create_work_from_future(fut)
    return run


def _max(pg, t: torch.Tensor) -> None:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    pg.allreduce([t], opts).wait()


def _eligible(kind: str, a: dict) -> bool:
    opts = a.get("opts")
    if kind in ("all_reduce", "reduce_scatter") and opts is not None and opts.reduceOp != dist.ReduceOp.SUM:
        return False
    tensors = a.get("tensors") or []
    if len(tensors) != 1 or tensors[0].is_cuda or not tensors[0].is_contiguous():
        return False
    if kind == "all_gather":
        return a.get("outputs") is not None or a.get("output") is not None
    if kind == "reduce_scatter":
        return a.get("inputs") is not None or a.get("input") is not None
    return True


def _reordered(pg, kind: str, order: tuple[int, ...], a: dict):
    """The native op on a group in which rank order[k] is number k: its ring runs in `order`."""
    p = len(order)
    if kind == "all_reduce":
        return pg.allreduce(a["tensors"], a["opts"])
    if kind == "all_gather":
        outs = a["outputs"] if a.get("outputs") is not None else list(a["output"].view(p, -1))
        return pg.allgather([[outs[order[k]] for k in range(p)]], a["tensors"], AllgatherOptions())
    ins = a["inputs"] if a.get("inputs") is not None else list(a["input"].view(p, -1))
    opts = ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    return pg.reduce_scatter(a["tensors"], [[ins[order[k]] for k in range(p)]], opts)


def step_boundary(step: int) -> list[dict]:
    """Called by every rank after each committed step: each adaptive group may re-plan (nothing in native mode).
    Returns the plan changes, for the run's events.jsonl."""
    if Seam.failed_generation == Seam.generation:
        return []  # a peer failed: recovery rebuilds the groups, and a rebuilt group starts native
    events = []
    for g in Seam.groups:
        if g.router is not None:
            events += g.router.boundary(step)
    return events
