"""The comm planner: an alpha-beta cost model fed with measured per-link bandwidth picks, per collective kind and
size, the native op, the native op on a group renumbered in a better ring order, or dtk's hierarchical all-reduce
with a congested host as a leaf. Decided at step boundaries from stats every rank shares, so all ranks agree."""
from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import asdict, dataclass, field

CONGESTED = 0.25
"""A link is congested when it measures below this fraction of the reference link, the upper quartile (noise on a
shared machine moves healthy links by 2x, a shaped one is 10x+ slower; a congested host slows half the links
of 4, so the median would not do)."""
SWITCH = 0.8
"""Change the plan only when the new one is predicted at most this fraction of the current one's time."""
CLEAN_PROBES = 2
"""Consecutive probes without a congested link before going back to native."""
ALPHA = 1e-4
"""Seconds per message step (latency term)."""
P2P_OVERHEAD = 2e-3
"""Extra seconds per call of a dtk p2p algorithm (Python pieces) over a native op."""
PIECE_BYTES = 256 << 10
"""Piece size of the hierarchical all-reduce: the congested host's stream pipelines in pieces of this size."""
REFERENCE_BYTES = 8 << 20
"""The size at which plans are compared for hysteresis."""
KINDS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class Choice:
    algo: str = "native"
    """native | reordered (the native op on a group whose ring runs in `order`) | leaf (hierarchical all-reduce:
    `groups`, each group's first rank leads)."""
    order: tuple[int, ...] = ()
    groups: tuple[tuple[int, ...], ...] = ()
    back: tuple[tuple[int, int], ...] = ()
    """(member, leader) pairs: the leader that streams the result back to a member (not its own leader)."""
    min_bytes: int = 0
    """Calls smaller than this stay native (latency wins over bandwidth)."""

    def describe(self) -> str:
        if self.algo == "reordered":
            return f"ring order {'-'.join(map(str, self.order))}"
        if self.algo == "leaf":
            via = "".join(f", {m} back from {b}" for m, b in self.back)
            return f"hierarchical {'|'.join(','.join(map(str, g)) for g in self.groups)}{via} (>= {self.min_bytes} B)"
        return "native"


NATIVE = Choice()


@dataclass
class Links:
    """Every rank's measured bandwidth to every peer (bytes/s), de-noised: a link is either congested (its own
    rate) or healthy (the median rate)."""

    raw: list[list[float]]
    bw: list[list[float]] = field(init=False)
    cap: list[float] = field(init=False)
    """Each host's link capacity: its best path (a host with one healthy path has a healthy link)."""
    congested: list[tuple[int, int, float]] = field(init=False)

    def __post_init__(self):
        p = len(self.raw)
        sym = [[min(_v(self.raw[i][j]), _v(self.raw[j][i])) if i != j else math.inf for j in range(p)] for i in range(p)]
        values = [sym[i][j] for i in range(p) for j in range(i + 1, p) if math.isfinite(sym[i][j])]
        median = _upper_quartile(values) if values else 1e9
        self.bw = [[math.inf if i == j else (sym[i][j] if sym[i][j] < CONGESTED * median else median)
                    for j in range(p)] for i in range(p)]
        self.congested = [(i, j, sym[i][j]) for i in range(p) for j in range(i + 1, p) if sym[i][j] < CONGESTED * median]
        self.cap = [max((self.bw[i][j] for j in range(p) if j != i), default=median) for i in range(p)]


def _upper_quartile(values: list[float]) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, (3 * len(v)) // 4)]


def _v(x: float) -> float:
    return x if x == x and x > 0 else math.inf  # unmeasured: no evidence of congestion


def ring_seconds(links: Links, order, nbytes: float, factor: float) -> float:
    p = len(order)
    if p < 2:
        return 0.0
    edge = min(links.bw[order[k]][order[(k + 1) % p]] for k in range(p))
    host = min(links.cap[r] for r in order)
    return factor * nbytes / min(edge, host) + 2 * (p - 1) * ALPHA


def best_order(links: Links, ranks: list[int]) -> tuple[int, ...]:
    """The ring order over `ranks` whose slowest edge is fastest (ties: the one closest to the given order)."""
    if len(ranks) <= 3:
        return tuple(ranks)
    first, rest = ranks[0], ranks[1:]
    candidates = [(first, *perm) for perm in itertools.permutations(rest)] if len(ranks) <= 8 else [tuple(ranks)]
    return max(candidates, key=lambda o: (min(links.bw[o[k]][o[(k + 1) % len(o)]] for k in range(len(o))),
                                          o == tuple(ranks)))


def leaf_seconds(links: Links, leaf: int, helper: int, rest: list[int], nbytes: float) -> float:
    p = len(rest) + 1
    stream = nbytes / min(links.bw[leaf][helper], links.cap[leaf])
    inner = ring_seconds(links, rest, nbytes, 2 * (p - 2) / (p - 1)) if len(rest) > 1 else 0.0
    pieces = max(1.0, nbytes / PIECE_BYTES)
    return max(stream, inner) * (1 + 1 / pieces) + P2P_OVERHEAD  # one piece of fill and drain


def seconds(links: Links, kind: str, choice: Choice, nbytes: float) -> float:
    p = len(links.bw)
    factor = 2 * (p - 1) / p if kind == "all_reduce" else (p - 1) / p
    if choice.algo == "native" or nbytes < choice.min_bytes:
        return ring_seconds(links, tuple(range(p)), nbytes, factor)
    if choice.algo == "reordered":
        return ring_seconds(links, choice.order, nbytes, factor)
    leaf_group = next(g for g in choice.groups if len(g) == 2)
    rest = [g[0] for g in choice.groups]
    return leaf_seconds(links, leaf_group[1], leaf_group[0], rest, nbytes)


def choose(links: Links, kind: str) -> Choice:
    """The best plan for `kind` at the reference size (and, for a leaf plan, from which size on it pays)."""
    p = len(links.bw)
    if not links.congested:
        return NATIVE
    candidates = [NATIVE]
    order = best_order(links, list(range(p)))
    if order != tuple(range(p)):
        candidates.append(Choice(algo="reordered", order=order))
    slow_hosts = [h for h in range(p) if links.cap[h] < CONGESTED * max(links.cap)]
    if kind == "all_reduce" and p >= 3 and len(slow_hosts) == 1:
        h = slow_hosts[0]
        rest = [r for r in range(p) if r != h]
        by_bw = sorted(rest, key=lambda r: (-links.bw[h][r], r))
        helper, returner = by_bw[0], by_bw[1]  # up and down on different connections (see hierarchical_all_reduce)
        others = [r for r in best_order(links, rest) if r != helper]
        groups = ((helper, h),) + tuple((r,) for r in others)
        leaf = Choice(algo="leaf", groups=groups, back=((h, returner),))
        # from which size on the leaf beats the best ring (doubling sizes from 64 KB)
        ring = candidates[-1]
        min_bytes = next((1 << k for k in range(16, 34) if seconds(links, kind, leaf, 1 << k)
                          < SWITCH * seconds(links, kind, ring, 1 << k)), None)
        if min_bytes is not None:
            candidates.append(Choice(algo="leaf", groups=groups, back=((h, returner),), min_bytes=min_bytes))
    return min(candidates, key=lambda c: seconds(links, kind, c, REFERENCE_BYTES))


@dataclass
class Decision:
    plan: dict[str, Choice]
    changed: list[str]
    evidence: dict


class PlanState:
    """The plan in force and the hysteresis around changing it; every rank holds an identical copy."""

    def __init__(self):
        self.plan: dict[str, Choice] = {k: NATIVE for k in KINDS}
        self.clean = 0

    def update(self, raw: list[list[float]], *, reason: str) -> Decision:
        links = Links(raw)
        self.clean = 0 if links.congested else self.clean + 1
        new, changed = dict(self.plan), []
        for kind in KINDS:
            cur, best = self.plan[kind], choose(links, kind)
            if best == cur:
                continue
            if best == NATIVE:
                go = self.clean >= CLEAN_PROBES or cur == NATIVE
            else:
                go = (seconds(links, kind, best, REFERENCE_BYTES)
                      < SWITCH * seconds(links, kind, cur, REFERENCE_BYTES))
            if go:
                new[kind] = best
                changed.append(kind)
        evidence = {
            "reason": reason,
            "congested_links": [{"link": f"{i}-{j}", "bytes_per_s": round(b)} for i, j, b in links.congested],
            "healthy_bytes_per_s": round(max(links.cap)),
            "predicted_seconds_8mb": {k: {"native": round(seconds(links, k, NATIVE, REFERENCE_BYTES), 5),
                                          "plan": round(seconds(links, k, new[k], REFERENCE_BYTES), 5)}
                                      for k in KINDS},
        }
        self.plan = new
        return Decision(plan=new, changed=changed, evidence=evidence)


def describe(plan: dict[str, Choice]) -> dict[str, str]:
    return {k: c.describe() for k, c in plan.items()}


def as_dict(choice: Choice) -> dict:
    return asdict(choice)
