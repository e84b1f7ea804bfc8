"""comm.mode adaptive: runs each collective of a DtkGroup the way the plan says (native, the native op on a
renumbered group, or a dtk p2p algorithm on a worker thread), feeds the monitor, and at step boundaries lets
every rank agree on the next plan (a tiny all-reduce of "probe?" flags, a probe, an all-gather of link rows), and
checks each plan change against what it delivers (dtk.comm.check; its figures ride on the same tiny all-reduce).

A renumbered group runs gloo's own op, so every reduce op gloo takes (SUM, AVG, MAX, ...) is taken there; dtk's
hierarchical all-reduce sums, and averages by dividing its sum by the group's size (what gloo's AVG does)."""
from __future__ import annotations

import collections
import datetime
import json
import logging
import queue
import threading
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceOptions, BroadcastOptions,
                                       ReduceOptions, ReduceScatterOptions)

from dtk.comm import algorithms
from dtk.comm.check import FIGURES, PlanCheck
from dtk.comm.monitor import MEASURABLE_BYTES, LinkMonitor
from dtk.comm.planner import KINDS, NATIVE, PIECE_BYTES, Choice, Decision, PlanState, describe
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
        self.ran: collections.Counter[tuple[str, str]] = collections.Counter()
        """(kind, way) -> calls: which way each collective ran (native, reordered, leaf, all_reduce)."""
        self.boundaries = 0
        self.last_probe = -1
        self.events: list[dict] = []
        """Plan changes not yet written out (the trainer or the bench writes them to events.jsonl)."""
        self.checks: dict[str, PlanCheck] = {}
        """Plan changes whose check is not yet due, by kind."""
        self._calls: dict[str, list[tuple[int, float]]] = {k: [] for k in KINDS}
        """(bytes, seconds) of the calls since the last boundary, each of at least MEASURABLE_BYTES."""
        self._calls_lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    # -- at issue time --
    def route(self, kind: str, native, **a):
        """The callable the seam runs on its inner group: the plan's way, or `native`."""
        choice = self.state.plan.get(kind, NATIVE)
        nbytes = a.pop("nbytes")
        way = "native" if choice.algo == "native" or nbytes < choice.min_bytes else _way(kind, choice, a)
        self.ran[(kind, way)] += 1
        if way == "native":
            return self._timed(kind, nbytes, native)
        if way == "leaf":
            return _guarded(lambda g: self._submit(lambda: self._leaf(choice, a["tensors"], a["opts"].reduceOp)))
        return _guarded(self._timed(kind, nbytes, lambda g: self._reordered(g, kind, way, choice, a)))

    def _reordered(self, g, kind: str, way: str, choice: Choice, a: dict):
        """The native op on the group the plan numbers for this call (`g`, the inner group, for the identity)."""
        if kind == "broadcast":
            numbering = choice.roots[a["opts"].rootRank]
            opts = BroadcastOptions()
            opts.rootRank, opts.rootTensor = 0, a["opts"].rootTensor  # the root is number 0 of its numbering
            return self._group_of(numbering, g).broadcast(a["tensors"], opts)
        pg = self._group_of(choice.order, g)
        if kind == "reduce" and way == "all_reduce":
            ar = AllreduceOptions()
            ar.reduceOp = a["opts"].reduceOp
            return pg.allreduce(a["tensors"], ar)  # a reduce leaves the other ranks' buffers undefined
        if kind == "reduce":
            ropts = ReduceOptions()
            ropts.reduceOp, ropts.rootTensor = a["opts"].reduceOp, a["opts"].rootTensor
            ropts.rootRank = choice.order.index(a["opts"].rootRank)
            return pg.reduce(a["tensors"], ropts)
        return _renumbered(pg, kind, choice.order, a)

    def _group_of(self, order: tuple[int, ...], g):
        return g if order == tuple(range(self.size)) else self.groups[order]

    def _timed(self, kind: str, nbytes: int, call):
        def run(g):
            t0 = time.perf_counter()
            work = call(g)
            try:
                work.get_future().add_done_callback(lambda f: self._observed(kind, nbytes, time.perf_counter() - t0))
            except RuntimeError:
                pass  # a work without a future (gloo's list reduce_scatter): not timed
            return work
        return run

    def _observed(self, kind: str, nbytes: int, seconds: float) -> None:
        self.monitor.observe_native(kind, nbytes, seconds)
        if nbytes >= MEASURABLE_BYTES:
            with self._calls_lock:
                self._calls[kind].append((nbytes, seconds))

    def _submit(self, job) -> "FutureWork":
        fut: torch.futures.Future = torch.futures.Future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dtk-comm", daemon=True)
            self._thread.start()
        self._jobs.put((job, fut))
        return FutureWork(fut)

    def _loop(self) -> None:
        while True:
            job, fut = self._jobs.get()
            try:
                job()
            except Exception as e:  # the seam turns this into a released step, never into a raise
                fut.set_exception(e)
            else:
                fut.set_result(None)

    def _leaf(self, choice: Choice, tensors: list[torch.Tensor], op) -> None:
        t0 = time.perf_counter()
        # coalesced tensors are summed as one flat buffer (one hierarchical call, then copied back)
        flat = tensors[0].view(-1) if len(tensors) == 1 else torch.cat([t.reshape(-1) for t in tensors])
        leaders = tuple(g[0] for g in choice.groups)
        sub = self._group(("leaders",) + leaders) if self.rank in leaders else None
        # torch's stub for Backend (ProcessGroupGloo's base) lists none of its send/recv
        p2p = algorithms.P2P(self.ctl)  # type: ignore[arg-type]
        algorithms.hierarchical_all_reduce(
            p2p, flat, groups=choice.groups, back=dict(choice.back), chunk_bytes=PIECE_BYTES,
            leader_all_reduce=(lambda x: sub.allreduce([x]).wait()) if sub is not None else None)
        if op == dist.ReduceOp.AVG:
            flat.div_(self.size)
        if len(tensors) > 1:
            for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
                t.copy_(part.view_as(t))
        self.monitor.observe_p2p(p2p.timings)
        if flat.nbytes >= MEASURABLE_BYTES:  # the plan's check times the whole call, as _timed does a native one
            with self._calls_lock:
                self._calls["all_reduce"].append((flat.nbytes, time.perf_counter() - t0))

    # -- groups a plan needs, built at the boundary by every member --
    def _group(self, key: tuple):
        return self.groups[key]

    def _build_groups(self, plan: dict[str, Choice]) -> None:
        """Every rank builds the same groups in the same order (a plan is the same on every rank)."""
        identity = tuple(range(self.size))
        for choice in plan.values():
            for order in (choice.order, *choice.roots) if choice.algo == "reordered" else ():
                if order and order != identity and order not in self.groups:
                    name = "order-" + "-".join(map(str, order))
                    self.groups[order] = dist.ProcessGroupGloo(
                        dist.PrefixStore(name, self._store), order.index(self.rank), self.size, self.timeout)
            if choice.algo == "leaf":
                leaders = tuple(g[0] for g in choice.groups)
                key = ("leaders",) + leaders
                if self.rank in leaders and key not in self.groups:
                    name = "leaders-" + "-".join(map(str, leaders))
                    self.groups[key] = dist.ProcessGroupGloo(
                        dist.PrefixStore(name, self._store), leaders.index(self.rank), len(leaders), self.timeout)

    # -- at a step boundary --
    def boundary(self, step: int | None = None) -> list[dict]:
        """Every rank calls this at the same point. Checks the plan changes whose check is due, probes when some rank
        asks (a slowed native collective, the first boundary, or a periodic recheck of a non-native plan), then
        decides; returns new events."""
        self.boundaries += 1
        slow = self.monitor.take_slow()
        with self._calls_lock:
            calls, self._calls = self._calls, {k: [] for k in KINDS}
        for kind, check in self.checks.items():
            check.after += calls[kind]
        periodic = self.state.plan != {k: NATIVE for k in self.state.plan} and \
            self.boundaries - self.last_probe >= PROBE_EVERY
        # why this rank asks for a probe, as a rank the MAX keeps: every rank then names the same reason
        want = 3.0 if self.last_probe < 0 else 2.0 if slow else 1.0 if periodic else 0.0
        # one tiny all-reduce carries both the "probe?" flag and every pending check's figures
        flags = torch.tensor([want] + [x for k in KINDS for x in (self.checks[k].figures() if k in self.checks
                                                                    else [0.0] * FIGURES)], dtype=torch.float64)
        _max(self.ctl, flags)
        agreed = flags.tolist()
        events = self._check(agreed[1:], step)
        if not agreed[0]:
            return events
        reason = {3: "first boundary", 2: "native collective slowed", 1: "recheck"}[int(agreed[0])]
        self.last_probe = self.boundaries
        t0 = time.perf_counter()
        row = torch.tensor(self.monitor.probe(self.ctl), dtype=torch.float64)
        rows = [torch.empty_like(row) for _ in range(self.size)]
        # torch's stub for Backend (ProcessGroupGloo's base) lists none of the collectives it has
        self.ctl.allgather([rows], [row]).wait()  # type: ignore[attr-defined]
        probe_s = time.perf_counter() - t0
        undone = {e["kind"] for e in events if e.get("verdict") == "undone"}
        before_calls = {k: [] if k in undone else c for k, c in calls.items()}  # the undone plan's are not the old's
        event = self.decide([r.tolist() for r in rows], reason=reason, step=step, calls=before_calls,
                            extra={"probe_seconds": round(probe_s, 4), "slow_collectives": slow[:4]})
        return events + ([event] if event else [])

    def decide(self, raw: list[list[float]], *, reason: str, step: int | None,
               calls: dict[str, list[tuple[int, float]]], extra: dict | None = None) -> dict | None:
        """The planner's decision on every rank's link rows (the same on every rank); a change starts its check
        (`calls`: the old plan's calls in the step before). Returns the comm_plan event, if the plan changed."""
        before = dict(self.state.plan)
        decision = self.state.update(raw, reason=reason)
        if not decision.changed:
            return None
        self._build_groups(decision.plan)
        for kind in decision.changed:
            self.checks.pop(kind, None)
            if decision.plan[kind] != NATIVE:  # going back to native is the safe way: nothing to check
                self.checks[kind] = PlanCheck(kind=kind, old=before[kind], new=decision.plan[kind],
                                              links=decision.links, step=step, before=calls.get(kind, []))
        return self._plan_event(decision, before, step, extra or {})

    def _plan_event(self, decision: Decision, before: dict[str, Choice], step: int | None, extra: dict) -> dict:
        event = {"event": "comm_plan", "step": step, "time": time.time(), "rank": self.rank,
                 "changed": decision.changed, "before": {k: before[k].describe() for k in decision.changed},
                 "after": {k: describe(decision.plan)[k] for k in decision.changed}, **extra, **decision.evidence}
        (log.warning if self.rank == 0 else log.info)("comm plan changed at step %s: %s (congested links: %s)", step,
                    json.dumps(event["after"]), [c["link"] for c in event["congested_links"]])
        self.events.append(event)
        return event

    def _check(self, agreed: list[float], step: int | None) -> list[dict]:
        """The due checks, on the figures every rank agreed on: a comm_plan_check event each, and for a plan that
        fell short, its undoing (a comm_plan event saying why)."""
        events = []
        for n, kind in enumerate(KINDS):
            check = self.checks.get(kind)
            verdict = check.verdict(agreed[n * FIGURES:(n + 1) * FIGURES]) if check is not None else None
            if check is None or verdict is None:
                continue
            del self.checks[kind]
            event = {"event": "comm_plan_check", "step": step, "time": time.time(), "rank": self.rank, **verdict}
            self.events.append(event)
            events.append(event)
            if verdict["verdict"] != "undone":
                continue
            self.state.undo(kind, to=check.old, links=check.links)
            self._build_groups(self.state.plan)
            why = (f"undone by its check: delivered {verdict['delivered_gain_s']:.6f} s of the "
                   f"{verdict['predicted_gain_s']:.6f} s per call the model promised")
            undo = {"event": "comm_plan", "step": step, "time": time.time(), "rank": self.rank, "changed": [kind],
                    "before": {kind: check.new.describe()}, "after": {kind: check.old.describe()}, "reason": why,
                    "undone": True, "congested_links": [{"link": f"{i}-{j}", "bytes_per_s": round(b)}
                                                        for i, j, b in check.links.congested]}
            (log.warning if self.rank == 0 else log.info)("comm plan for %s %s at step %s", kind, why, step)
            self.events.append(undo)
            events.append(undo)
        return events


class FutureWork:
    """A work done on the router's thread, waited as the seam waits gloo's works: in slices, a slice that ends
    first raising gloo's "Operation timed out!" (a work made by c10d from a future takes no finite timeout)."""

    def __init__(self, fut: torch.futures.Future):
        self._fut, self._done = fut, threading.Event()
        fut.add_done_callback(lambda _: self._done.set())

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError("Operation timed out!")
        self._fut.wait()  # raises the job's error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def get_future(self) -> torch.futures.Future:
        return self._fut


def _guarded(call):
    """An error while issuing a dtk route becomes a failed work (the seam releases the step), never a raise."""
    def run(g):
        try:
            return call(g)
        except Exception as e:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_exception(e)
            return FutureWork(fut)
    return run


def _max(pg, t: torch.Tensor) -> None:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]  # stub: MAX is a RedOpType, which pybind converts
    pg.allreduce([t], opts).wait()


REDUCING = ("all_reduce", "reduce_scatter", "reduce")


def _way(kind: str, choice: Choice, a: dict) -> str:
    """How this call runs under `choice`: native, reordered, leaf, or (a reduce) all_reduce."""
    tensors = a.get("tensors") or []
    if not tensors or any(t.is_cuda for t in tensors) or (len(tensors) != 1 and not a.get("coalesced")):
        return "native"
    op = a["opts"].reduceOp if kind in REDUCING else None
    if op is not None and op == dist.ReduceOp.PREMUL_SUM:
        return "native"  # gloo refuses it: the seam reports gloo's own error, as it does without a plan
    if choice.algo == "leaf":
        sums = op == dist.ReduceOp.SUM or (op == dist.ReduceOp.AVG and all(t.is_floating_point() for t in tensors))
        return "leaf" if kind == "all_reduce" and sums and len({t.dtype for t in tensors}) == 1 \
            and (len(tensors) > 1 or tensors[0].is_contiguous()) else "native"
    if kind == "broadcast":
        return "reordered" if choice.roots and choice.roots[a["opts"].rootRank] else "native"
    if kind == "reduce":
        if a["opts"].rootRank in choice.via_all_reduce:
            return "all_reduce"
        return "native" if choice.order == tuple(range(len(choice.order))) else "reordered"
    if kind == "all_gather":
        flat = a.get("output")
        lists = a.get("outputs") is not None or a.get("output_lists") is not None
        return "reordered" if lists or (flat is not None and flat.is_contiguous()) else "native"
    if kind == "reduce_scatter":
        flat = a.get("input")
        return "reordered" if a.get("inputs") is not None or (flat is not None and flat.is_contiguous()) else "native"
    return "reordered"


def _renumbered(pg, kind: str, order: tuple[int, ...], a: dict):
    """The native op on a group in which rank order[k] is number k: its ring runs in `order`."""
    p = len(order)
    if kind == "all_reduce" and a.get("coalesced"):
        return pg.allreduce_coalesced(a["tensors"], a["opts"])
    if kind == "all_reduce":
        return pg.allreduce(a["tensors"], a["opts"])
    if kind == "all_gather" and a.get("output_lists") is not None:  # coalesced: one output list per rank
        return pg.allgather_coalesced([a["output_lists"][order[k]] for k in range(p)], a["tensors"], AllgatherOptions())
    if kind == "all_gather":
        outs = a["outputs"] if a.get("outputs") is not None else list(a["output"].view(p, -1))
        return pg.allgather([[outs[order[k]] for k in range(p)]], a["tensors"], AllgatherOptions())
    ins = a["inputs"] if a.get("inputs") is not None else list(a["input"].view(p, -1))
    opts = ReduceScatterOptions()
    opts.reduceOp = a["opts"].reduceOp
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
