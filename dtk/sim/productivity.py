"""Productive time of a synchronous training job under random node failures, per recovery method.

Failures arrive per node as a Poisson process in wall time; each one costs its method a stall, and stalls queue
(a failure during a stall adds its own). The timeline is built with numpy in one pass, so millions of GPUs are fast.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

DAY_S = 86_400.0

METHODS = {
    "checkpoint": "stop all, restart, reload the last checkpoint, redo the work since it (checkpoints every tau)",
    "inplace": "dtk: detect, promote a shadow, regroup, rebuild the lost state, redo the steps since the last "
               "protection; the protection costs a share of every step's throughput",
    "replica": "fault-tolerant HSDP: a short full stall, then one replica offline while the rest train on",
}


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The job's size and how often its nodes fail."""

    gpus: int
    gpus_per_node: int = 8
    failures_per_1000_node_days: float = 6.5
    days: float = 30.0

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    @property
    def failure_rate_per_s(self) -> float:
        """Failures per second of the whole job (any node failing fails the synchronous job)."""
        return self.nodes * self.failures_per_1000_node_days / 1000.0 / DAY_S

    @property
    def mttf_s(self) -> float:
        return 1.0 / self.failure_rate_per_s

    @property
    def period_s(self) -> float:
        return self.days * DAY_S


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """Checkpoint-restart: blocking saves every `every_s` of work (None: Young/Daly), a restart that grows with size."""

    every_s: float | None = None
    save_s: float = 30.0
    restart_s: float = 600.0
    restart_per_doubling_s: float = 0.0

    def restart_at(self, cluster: Cluster) -> float:
        """Detect + restart + load at this size: the constant plus a term per doubling of the node count."""
        return self.restart_s + self.restart_per_doubling_s * math.log2(max(1, cluster.nodes))

    def interval_at(self, cluster: Cluster) -> float:
        return self.every_s if self.every_s is not None else daly_interval(
            save_s=self.save_s, mttf_s=cluster.mttf_s, restart_s=self.restart_at(cluster))


@dataclass(frozen=True, kw_only=True)
class InPlace:
    """dtk's in-place recovery: the whole job stalls `recovery_s` per failure (detect to the redone step) plus
    `redo_s` (the steps since the last protection, redone after a rollback); the in-memory protection takes
    `protection_cost` of the throughput all the time, failure or not. A `fallback` fraction of failures it cannot
    repair (e.g. two in one parity group) costs a checkpoint restart instead, and then the job also saves
    checkpoints as `checkpoint` says."""

    recovery_s: float = 5.0
    protection_cost: float = 0.0
    redo_s: float = 0.0
    fallback: float = 0.0
    checkpoint: Checkpoint = Checkpoint()

    @property
    def stall_s(self) -> float:
        """What one repaired failure costs the whole job."""
        return self.recovery_s + self.redo_s

    def interval_at(self, cluster: Cluster) -> float:
        """Checkpoint interval for the fallback: given, or Young/Daly at the rate of the failures that need it."""
        ckpt = self.checkpoint
        return ckpt.every_s if ckpt.every_s is not None else daly_interval(
            save_s=ckpt.save_s, mttf_s=cluster.mttf_s / self.fallback, restart_s=ckpt.restart_at(cluster))


@dataclass(frozen=True, kw_only=True)
class Replica:
    """Replica-group recovery: a full stall, then one of `replicas` offline for `rejoin_s` while the others train."""

    replicas: int = 12
    stall_s: float = 180.0
    rejoin_s: float = 420.0


Method = Checkpoint | InPlace | Replica


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """One simulated period: what fraction of it trained, and the first-order formula's figure for comparison."""

    productive_time_ratio: float
    failures: int
    first_order: float
    details: dict


def daly_interval(*, save_s: float, mttf_s: float, restart_s: float = 0.0) -> float:
    """Daly's (2006) higher-order optimal compute time between checkpoints; Young's sqrt(2 delta M) to first order."""
    m = mttf_s + restart_s
    if save_s <= 0:
        return 0.0  # saving is free: checkpoint continuously, nothing is ever lost
    if save_s >= 2 * m:
        return m
    x = save_s / (2 * m)
    return math.sqrt(2 * save_s * m) * (1 + math.sqrt(x) / 3 + x / 9) - save_s


def failure_times(cluster: Cluster, *, seed: int) -> np.ndarray:
    """Sorted wall times of the job's failures in [0, period): a Poisson process at the job's rate."""
    rng = np.random.default_rng(seed)
    n = rng.poisson(cluster.failure_rate_per_s * cluster.period_s)
    return np.sort(rng.uniform(0.0, cluster.period_s, size=n))


def first_order(method: Method, cluster: Cluster) -> float:
    """The textbook estimate, each failure's cost divided by the mean time to failure (Young/Daly for checkpoint)."""
    m = cluster.mttf_s
    if isinstance(method, Checkpoint):
        tau = method.interval_at(cluster)
        value = 1 - (method.save_s / tau if tau > 0 else 0.0) - (tau / 2 + method.restart_at(cluster)) / m
    elif isinstance(method, InPlace):
        p, value = method.fallback, 1 - method.stall_s / m
        if p > 0:
            tau, ckpt = method.interval_at(cluster), method.checkpoint
            value = 1 - (1 - p) * method.stall_s / m - (ckpt.save_s / tau if tau > 0 else 0.0) - p * (
                tau / 2 + ckpt.restart_at(cluster)) / m
        value *= 1 - method.protection_cost
    else:
        value = 1 - (method.stall_s + method.rejoin_s / method.replicas) / m
    return max(0.0, value)


def _stall_ends(arrivals: np.ndarray, stalls: float | np.ndarray) -> np.ndarray:
    """When each failure's stall ends, stalls served one after another: F_n = max(F_{n-1}, A_n) + S_n, unrolled to
    F_n = C_n + max_k<=n (A_k - C_k-1) with C the running sum of stalls, so it needs no Python loop."""
    s = np.broadcast_to(np.asarray(stalls, dtype=float), arrivals.shape)
    total = np.cumsum(s)
    return total + np.maximum.accumulate(arrivals - (total - s))


def _kept_with_checkpoints(segments: np.ndarray, rollback: np.ndarray, *, tau: float, save_s: float) -> float:
    """Work kept when a save completes after every `tau` of work and each failure flagged in `rollback` throws away
    what came after the last completed save. Segment j ends at failure j (the last at the period's end, which loses
    nothing); run time adds up across failures that do not roll back, so the save cycle goes on through them."""
    cycle = tau + save_s
    if cycle <= 0:  # saving is free and continuous
        return float(segments.sum())
    epoch = np.concatenate(([0], np.cumsum(rollback)))  # which stretch between rollbacks each segment is in
    run = np.bincount(epoch, weights=segments)
    kept = np.floor(run / cycle) * tau
    kept[-1] = math.floor(run[-1] / cycle) * tau + min(run[-1] % cycle, tau)
    return float(kept.sum())


def _fallbacks(count: int, fraction: float, seed: int) -> np.ndarray:
    """Which failures in-place recovery cannot repair: each independently with probability `fraction`."""
    return np.random.default_rng([seed, 1]).random(count) < fraction


def _running_segments(arrivals: np.ndarray, ends: np.ndarray, period: float) -> np.ndarray:
    """Lengths of the stretches in which the job runs (no stall under way), each starting fresh after a stall."""
    starts = np.concatenate(([0.0], ends))
    stops = np.concatenate((arrivals, [period]))
    return np.clip(np.minimum(stops, period) - np.minimum(starts, period), 0.0, None)


def _degraded_loss(ends: np.ndarray, period: float, *, stall_s: float, rejoin_s: float, replicas: int) -> float:
    """Training time lost while replicas are offline: each one costs 1/replicas of the throughput while the job runs
    (never more than all of it). Swept over every change point at once."""
    times = np.concatenate((ends - stall_s, ends, ends, ends + rejoin_s, [period]))
    d_stall = np.concatenate((np.ones_like(ends), -np.ones_like(ends), np.zeros_like(ends), np.zeros_like(ends), [0]))
    d_off = np.concatenate((np.zeros_like(ends), np.zeros_like(ends), np.ones_like(ends), -np.ones_like(ends), [0]))
    order = np.argsort(times, kind="stable")
    times, stalled, offline = times[order], np.cumsum(d_stall[order]), np.cumsum(d_off[order])
    lengths = np.diff(np.minimum(times, period))
    running = stalled[:-1] <= 0
    lost = np.minimum(offline[:-1] / replicas, 1.0)
    return float(np.sum(lengths * running * lost))


def simulate(method: Method, cluster: Cluster, *, seed: int = 0, arrivals: np.ndarray | None = None) -> Outcome:
    """One period of the job under `method`; the same seed gives the same failures for every method."""
    arrivals = failure_times(cluster, seed=seed) if arrivals is None else arrivals
    period = cluster.period_s
    details: dict = {"mttf_s": cluster.mttf_s}
    if isinstance(method, Checkpoint):
        restart, tau = method.restart_at(cluster), method.interval_at(cluster)
        segments = _running_segments(arrivals, _stall_ends(arrivals, restart), period)
        productive = _kept_with_checkpoints(segments, np.ones(len(arrivals), dtype=bool), tau=tau,
                                            save_s=method.save_s)
        details.update(checkpoint_every_s=tau, restart_s=restart, save_s=method.save_s)
    elif isinstance(method, InPlace):
        rollback = _fallbacks(len(arrivals), method.fallback, seed)
        stalls = np.where(rollback, method.checkpoint.restart_at(cluster), method.stall_s)
        segments = _running_segments(arrivals, _stall_ends(arrivals, stalls), period)
        details.update(recovery_s=method.recovery_s, redo_s=method.redo_s, protection_cost=method.protection_cost,
                       fallback=method.fallback, fallback_failures=int(rollback.sum()))
        if method.fallback > 0:
            tau = method.interval_at(cluster)
            productive = _kept_with_checkpoints(segments, rollback, tau=tau, save_s=method.checkpoint.save_s)
            details.update(checkpoint_every_s=tau)
        else:  # nothing to fall back on: no checkpoints, nothing ever lost
            productive = float(segments.sum())
        productive *= 1 - method.protection_cost  # the protection slows every step the job runs
    else:
        ends = _stall_ends(arrivals, method.stall_s)
        running = float(_running_segments(arrivals, ends, period).sum())
        productive = running - _degraded_loss(ends, period, stall_s=method.stall_s, rejoin_s=method.rejoin_s,
                                              replicas=method.replicas)
        details.update(replicas=method.replicas, stall_s=method.stall_s, rejoin_s=method.rejoin_s)
    return Outcome(productive_time_ratio=productive / period, failures=int(len(arrivals)),
                   first_order=first_order(method, cluster), details=details)


RECOVERY_KNOB = {"checkpoint": "restart_s", "inplace": "recovery_s + redo_s", "replica": "stall_s + rejoin_s"}


def with_recovery(method: Method, seconds: float) -> Method:
    """The same method with its per-failure recovery time set to `seconds`: a checkpoint's restart (an interval left
    to Young/Daly is re-optimised for it), the in-place stall, or a replica's stall + time offline (split as before)."""
    from dataclasses import replace

    if isinstance(method, Checkpoint):
        return replace(method, restart_s=seconds)
    if isinstance(method, InPlace):
        return replace(method, recovery_s=seconds, redo_s=0.0)
    total = method.stall_s + method.rejoin_s
    stall_share = method.stall_s / total if total > 0 else 1.0
    return replace(method, stall_s=seconds * stall_share, rejoin_s=seconds * (1 - stall_share))


def method_name(method: Method) -> str:
    return {Checkpoint: "checkpoint", InPlace: "inplace", Replica: "replica"}[type(method)]


def recovery_needed(method: Method, cluster: Cluster, *, target: float, seed: int = 0) -> float | None:
    """The largest per-failure recovery time (see `with_recovery`) for which the simulation reaches
    `target`, on the same failures; None when even an instant recovery does not (e.g. checkpoint saves cost more),
    infinity when the period has no failure at all."""
    arrivals = failure_times(cluster, seed=seed)
    if len(arrivals) == 0:
        return math.inf

    def ratio(seconds: float) -> float:
        return simulate(with_recovery(method, seconds), cluster, seed=seed, arrivals=arrivals).productive_time_ratio

    if ratio(0.0) < target:
        return None
    lo, hi = 0.0, cluster.mttf_s
    while ratio(hi) >= target:  # the ratio falls as recovery grows; widen until it drops below the target
        lo, hi = hi, hi * 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) >= target else (lo, mid)
    return lo


def study(*, gpus: list[int], methods: dict[str, Method], gpus_per_node: int, failures_per_1000_node_days: float,
          days: float, seed: int, target: float | None = None) -> list[dict]:
    """Every method at every size, on the same failures per size; with `target`, also each method's recovery time
    needed to reach it."""
    rows = []
    for g in gpus:
        cluster = Cluster(gpus=g, gpus_per_node=gpus_per_node, days=days,
                          failures_per_1000_node_days=failures_per_1000_node_days)
        arrivals = failure_times(cluster, seed=seed)
        row: dict[str, Any] = {"gpus": g, "nodes": cluster.nodes, "mttf_h": cluster.mttf_s / 3600, "methods": {}}
        for name, method in methods.items():
            outcome = simulate(method, cluster, seed=seed, arrivals=arrivals)
            entry = {"productive_time_ratio": outcome.productive_time_ratio, "failures": outcome.failures,
                     "first_order": outcome.first_order, **outcome.details}
            if target is not None:
                entry["recovery_needed_s"] = recovery_needed(method, cluster, target=target, seed=seed)
                entry["recovery_knob"] = RECOVERY_KNOB[name]
            row["methods"][name] = entry
        rows.append(row)
    return rows


def crossover_gpus(inplace: InPlace, checkpoint: Checkpoint, *, gpus_per_node: int,
                   failures_per_1000_node_days: float, days: float, up_to: int) -> int | None:
    """The smallest job (GPUs, whole nodes) from which in place keeps more of the time than checkpoint restart, by
    the first-order formulas (smooth in the size, where a simulation of a small job sees a handful of failures).
    Checkpointing loses more per node added, so the difference only grows: bisect on the node count. 0 when in
    place wins from a single node, None when it wins at no size up to `up_to` GPUs (its protection costs more than
    checkpointing loses)."""
    def gain(nodes: int) -> float:
        cluster = Cluster(gpus=nodes * gpus_per_node, gpus_per_node=gpus_per_node, days=days,
                          failures_per_1000_node_days=failures_per_1000_node_days)
        return first_order(inplace, cluster) - first_order(checkpoint, cluster)

    lo, hi = 1, max(1, math.ceil(up_to / gpus_per_node))
    if gain(lo) > 0:
        return 0
    if gain(hi) <= 0:
        return None
    while hi - lo > 1:  # gain(lo) <= 0 < gain(hi)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if gain(mid) > 0 else (mid, hi)
    return hi * gpus_per_node
