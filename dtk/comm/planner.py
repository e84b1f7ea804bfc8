"""The comm planner: an alpha-beta cost model fed with measured per-link bandwidth picks, per collective kind and
size, the native op, the native op on a group renumbered in a better ring order (for a broadcast: a numbering per
root that keeps gloo's binomial tree off slow links; for a reduce: some roots served by an all-reduce instead), or
dtk's hierarchical all-reduce with a congested host as a leaf. Decided at step boundaries from stats every rank
shares, so all ranks agree."""
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
UNDONE_PROBES = 4
"""A plan undone by its check (dtk.comm.check) is not picked again on the same evidence (the same congested links)
for this many probes, doubled each time it is undone again: a fluke of the check costs a few probes, a model that
keeps overpromising on that evidence is retried ever more rarely, and the plan never flaps."""
ALPHA = 1e-4
"""Seconds per message step (latency term)."""
P2P_OVERHEAD = 2e-3
"""Extra seconds per call of a dtk p2p algorithm (Python pieces) over a native op."""
PIECE_BYTES = 256 << 10
"""Piece size of the hierarchical all-reduce: the congested host's stream pipelines in pieces of this size."""
REFERENCE_BYTES = 8 << 20
"""The size at which plans are compared for hysteresis."""
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "reduce", "broadcast")
MAX_SEARCH = 8
"""Largest group whose ring orders are searched over every permutation."""
TREE_SEARCH = 6
"""Largest group whose broadcast numberings are searched over every permutation (per root: p x (p-1)!)."""


@dataclass(frozen=True)
class Choice:
    algo: str = "native"
    """native | reordered (the native op on a group whose ring runs in `order`) | leaf (hierarchical all-reduce:
    `groups`, each group's first rank leads)."""
    order: tuple[int, ...] = ()
    groups: tuple[tuple[int, ...], ...] = ()
    back: tuple[tuple[int, int], ...] = ()
    """(member, leader) pairs: the leader that streams the result back to a member (not its own leader)."""
    roots: tuple[tuple[int, ...], ...] = ()
    """broadcast: per root, the numbering of the group it runs on (roots[r][0] == r, so r is number 0 and rank
    roots[r][v] is gloo's virtual rank v); () for a root that keeps the native numbering."""
    via_all_reduce: tuple[int, ...] = ()
    """reduce: the roots whose reduce runs as an all-reduce on `order` (gloo's reduce gathers each rank's chunk
    straight to the root, whatever the numbering: a slow link into the root is avoided only this way)."""
    min_bytes: int = 0
    """Calls smaller than this stay native (latency wins over bandwidth)."""

    def describe(self) -> str:
        if self.algo == "reordered" and self.roots:
            return "tree numbering " + ", ".join(f"root {r}: {'-'.join(map(str, o))}"
                                                 for r, o in enumerate(self.roots) if o)
        if self.algo == "reordered":
            via = f" (all-reduce for roots {','.join(map(str, self.via_all_reduce))})" if self.via_all_reduce else ""
            return f"ring order {'-'.join(map(str, self.order))}{via}"
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
    candidates = [(first, *perm) for perm in itertools.permutations(rest)] if len(ranks) <= MAX_SEARCH \
        else [tuple(ranks)]
    return max(candidates, key=lambda o: (min(links.bw[o[k]][o[(k + 1) % len(o)]] for k in range(len(o))),
                                          o == tuple(ranks)))


def leaf_seconds(links: Links, leaf: int, helper: int, rest: list[int], nbytes: float) -> float:
    p = len(rest) + 1
    stream = nbytes / min(links.bw[leaf][helper], links.cap[leaf])
    inner = ring_seconds(links, rest, nbytes, 2 * (p - 2) / (p - 1)) if len(rest) > 1 else 0.0
    pieces = max(1.0, nbytes / PIECE_BYTES)
    return max(stream, inner) * (1 + 1 / pieces) + P2P_OVERHEAD  # one piece of fill and drain


def gather_seconds(links: Links, root: int, nbytes: float) -> float:
    """gloo's reduce ends with every rank sending its 1/p chunk straight to the root."""
    p = len(links.bw)
    into = max(nbytes / p / min(links.bw[r][root], links.cap[r]) for r in range(p) if r != root)
    return max(into, (p - 1) * nbytes / p / links.cap[root]) + ALPHA


def tree_seconds(links: Links, vranks, nbytes: float) -> float:
    """gloo's broadcast: a binomial tree over virtual ranks (the root is 0); in round i each v < 2^i sends the whole
    buffer to v + 2^i, and a round ends with its slowest transfer. vranks[v] is the rank at virtual rank v."""
    p, total, step = len(vranks), 0.0, 1
    while step < p:
        total += max(nbytes / min(links.bw[vranks[v]][vranks[v + step]], links.cap[vranks[v]],
                                  links.cap[vranks[v + step]]) for v in range(min(step, p - step))) + ALPHA
        step *= 2
    return total


def native_vranks(p: int, root: int) -> tuple[int, ...]:
    return tuple((root + v) % p for v in range(p))


def reduce_seconds(links: Links, order, via_all_reduce, root: int, nbytes: float) -> float:
    p = len(order)
    if root in via_all_reduce:
        return ring_seconds(links, order, nbytes, 2 * (p - 1) / p)
    return ring_seconds(links, order, nbytes, (p - 1) / p) + gather_seconds(links, root, nbytes)


def seconds(links: Links, kind: str, choice: Choice, nbytes: float) -> float:
    """Predicted seconds of one call; for reduce and broadcast, the mean over roots (ZeRO reduces each partition
    to its owner in turn)."""
    p = len(links.bw)
    native = choice.algo == "native" or nbytes < choice.min_bytes
    if kind == "broadcast":
        return sum(tree_seconds(links, choice.roots[r] if not native and choice.roots and choice.roots[r]
                                else native_vranks(p, r), nbytes) for r in range(p)) / p
    if kind == "reduce":
        order, via = (tuple(range(p)), ()) if native else (choice.order, choice.via_all_reduce)
        return sum(reduce_seconds(links, order, via, r, nbytes) for r in range(p)) / p
    factor = 2 * (p - 1) / p if kind == "all_reduce" else (p - 1) / p
    if native:
        return ring_seconds(links, tuple(range(p)), nbytes, factor)
    if choice.algo == "reordered":
        return ring_seconds(links, choice.order, nbytes, factor)
    leaf_group = next(g for g in choice.groups if len(g) == 2)
    rest = [g[0] for g in choice.groups]
    return leaf_seconds(links, leaf_group[1], leaf_group[0], rest, nbytes)


def best_tree(links: Links, root: int) -> tuple[int, ...]:
    """The numbering (root first) whose binomial broadcast is fastest; () when the native one is as fast. Every
    numbering up to TREE_SEARCH ranks; above, greedily: each next virtual rank takes the rank with the fastest link
    from its tree parent (v's parent is v without its highest bit)."""
    p = len(links.bw)
    native = native_vranks(p, root)
    if p <= TREE_SEARCH:
        candidates = [(root, *perm) for perm in itertools.permutations(native[1:])]
    else:
        greedy, left = [root], list(native[1:])
        for v in range(1, p):
            parent = greedy[v ^ (1 << (v.bit_length() - 1))]
            pick = max(left, key=lambda r: (min(links.bw[parent][r], links.cap[r]), -left.index(r)))
            greedy.append(pick)
            left.remove(pick)
        candidates = [native, tuple(greedy)]
    best = min(candidates, key=lambda o: (tree_seconds(links, o, REFERENCE_BYTES), o != native))
    return () if best == native else best


def choose_rooted(links: Links, kind: str) -> Choice:
    """reduce and broadcast: a numbering for every root at once, so that each call maps its root."""
    p = len(links.bw)
    if kind == "broadcast":
        roots = tuple(best_tree(links, r) for r in range(p))
        return Choice(algo="reordered", roots=roots) if any(roots) else NATIVE
    order = best_order(links, list(range(p)))
    # gloo's reduce moves as many bytes into the root as an all-reduce does: only a slow link into the root tips it
    via = tuple(r for r in range(p) if reduce_seconds(links, order, (r,), r, REFERENCE_BYTES)
                < SWITCH * reduce_seconds(links, order, (), r, REFERENCE_BYTES))
    if order == tuple(range(p)) and not via:
        return NATIVE
    return Choice(algo="reordered", order=order, via_all_reduce=via)


def choose(links: Links, kind: str) -> Choice:
    """The best plan for `kind` at the reference size (and, for a leaf plan, from which size on it pays)."""
    p = len(links.bw)
    if not links.congested:
        return NATIVE
    if kind in ("reduce", "broadcast"):
        return min([NATIVE, choose_rooted(links, kind)], key=lambda c: seconds(links, kind, c, REFERENCE_BYTES))
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
    links: Links
    """What the decision was made on (a check predicts the new and the old plan's times from it)."""


def evidence_key(links: Links) -> frozenset[tuple[int, int]]:
    """The evidence a plan was chosen on, as far as undoing it goes: which links are congested."""
    return frozenset((i, j) for i, j, _ in links.congested)


class PlanState:
    """The plan in force and the hysteresis around changing it; every rank holds an identical copy."""

    def __init__(self):
        self.plan: dict[str, Choice] = {k: NATIVE for k in KINDS}
        self.clean = 0
        self.probes = 0
        self.undone: dict[tuple[str, Choice, frozenset], tuple[int, int]] = {}
        """(kind, choice, evidence key) -> (times undone, last probe on which it is barred)."""

    def undo(self, kind: str, *, to: Choice, links: Links) -> None:
        """The check found the plan for `kind` short of its promise: back to `to`, and the undone choice barred on
        this evidence for UNDONE_PROBES probes, doubled on each further undo."""
        key = (kind, self.plan[kind], evidence_key(links))
        times = self.undone.get(key, (0, 0))[0] + 1
        self.undone[key] = (times, self.probes + UNDONE_PROBES * 2 ** (times - 1))
        self.plan[kind] = to

    def barred(self, kind: str, choice: Choice, links: Links) -> bool:
        entry = self.undone.get((kind, choice, evidence_key(links)))
        return entry is not None and self.probes <= entry[1]

    def update(self, raw: list[list[float]], *, reason: str) -> Decision:
        links = Links(raw)
        self.probes += 1
        self.clean = 0 if links.congested else self.clean + 1
        new, changed, held = dict(self.plan), [], []
        for kind in KINDS:
            cur, best = self.plan[kind], choose(links, kind)
            if best == cur:
                continue
            if self.barred(kind, best, links):
                held.append(kind)
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
        if held:
            evidence["held_back"] = {k: "undone by its check on this evidence" for k in held}
        self.plan = new
        return Decision(plan=new, changed=changed, evidence=evidence, links=links)


def describe(plan: dict[str, Choice]) -> dict[str, str]:
    return {k: c.describe() for k, c in plan.items()}


def as_dict(choice: Choice) -> dict:
    return asdict(choice)
