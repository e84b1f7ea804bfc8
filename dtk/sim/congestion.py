"""All-reduce under congested links: an alpha-beta model of native and adaptive plans over a star, fat tree or rails.

A plan is phases of point-to-point transfers; a phase takes alpha per step plus its busiest link's bytes / capacity
(links are directed, full duplex; a shaped host pair is a link of its own). Self-contained on purpose: the comm
layer's planner can be checked against it, and both against `dtk bench comm --testbed`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TypeAlias

import numpy as np

TOPOLOGIES = {
    "star": "every host on one switch (the test bed: namespaces on one bridge)",
    "fat-tree": "hosts on leaf switches, leaves on spines at full bisection, one spine per host pair (ECMP hash)",
    "rails": "each host has one NIC per rail, rail r of every host on switch r; every transfer is split over rails",
}
# tbf counts whole frames: a 1500-byte MTU frame carries 1448 bytes of TCP payload (with timestamps)
PAYLOAD_PER_FRAME = 1448 / 1514
# the test bed's unshaped link, as gloo sees it on this machine kind: 3 ranks all-reduce 64 MiB in 0.13-0.17 s
# (FACTS.md), i.e. each ring hop moved 4/3 x 64 MiB in ~0.15 s
TESTBED_HOST_BPS = 4 / 3 * 64 * 2**20 / 0.15

Routes: TypeAlias = dict[tuple[int, int], list[tuple[int, ...]]]
"""Per ordered host pair, its parallel paths, each the link ids it crosses."""


@dataclass(frozen=True)
class Network:
    """Directed links with capacities (bytes/s), and for each ordered host pair its parallel paths (equal split)."""

    hosts: int
    capacity: np.ndarray
    names: list[str]
    routes: Routes
    host_links: list[list[int]] = field(default_factory=list)  # per host: the links only its own traffic uses

    @cached_property
    def path_links(self) -> np.ndarray:
        """routes as an array [src, dst, path, hop] of link ids, padded with -1 (a link that never limits)."""
        width = max(len(p) for paths in self.routes.values() for p in paths)
        many = max(len(paths) for paths in self.routes.values())
        out = np.full((self.hosts, self.hosts, many, width), -1, dtype=np.int64)
        for (a, b), paths in self.routes.items():
            for i, path in enumerate(paths):
                out[a, b, i, :len(path)] = path
        return out

    def hop_rates(self) -> np.ndarray:
        """[src, dst] bytes/s a lone transfer gets: its paths each run at their slowest link, split evenly."""
        cap = np.append(self.capacity, np.inf)  # index -1: the padding
        per_path = cap[self.path_links].min(axis=3)
        rates = per_path.shape[2] * per_path.min(axis=2)
        np.fill_diagonal(rates, np.inf)
        return rates


@dataclass(frozen=True)
class Phase:
    transfers: list[tuple[int, int, float]]  # (source host, destination host, bytes)
    steps: int  # sequential messages: the alpha term


def star(*, hosts: int, host_bps: float) -> Network:
    cap = np.full(2 * hosts, float(host_bps))
    names = [f"host{h} {d}" for h in range(hosts) for d in ("out", "in")]
    routes: Routes = {(a, b): [(2 * a, 2 * b + 1)] for a in range(hosts) for b in range(hosts) if a != b}
    return Network(hosts, cap, names, routes, [[2 * h, 2 * h + 1] for h in range(hosts)])


def fat_tree(*, hosts: int, host_bps: float, hosts_per_leaf: int = 8, spines: int = 4) -> Network:
    leaves = -(-hosts // hosts_per_leaf)
    net = star(hosts=hosts, host_bps=host_bps)
    names, cap = list(net.names), list(net.capacity)
    up = {}
    for leaf in range(leaves):
        for s in range(spines):
            for d in ("up", "down"):
                up[leaf, s, d] = len(names)
                names.append(f"leaf{leaf} {d} spine{s}")
                cap.append(host_bps * hosts_per_leaf / spines)
    routes: Routes = {}
    for (a, b), [(out, into)] in net.routes.items():
        la, lb = a // hosts_per_leaf, b // hosts_per_leaf
        s = (a * 7 + b * 13) % spines  # ECMP: a fixed hash of the pair picks the spine
        routes[a, b] = [(out, into) if la == lb else (out, up[la, s, "up"], up[lb, s, "down"], into)]
    return Network(hosts, np.array(cap), names, routes, net.host_links)


def rails(*, hosts: int, host_bps: float, rails: int = 8) -> Network:
    """`host_bps` is one NIC's rate; a host has `rails` of them."""
    n_links = 2 * hosts
    cap = np.full(rails * n_links, float(host_bps))
    names = [f"rail{r} host{h} {d}" for r in range(rails) for h in range(hosts) for d in ("out", "in")]
    routes: Routes = {(a, b): [(r * n_links + 2 * a, r * n_links + 2 * b + 1) for r in range(rails)]
              for a in range(hosts) for b in range(hosts) if a != b}
    host_links = [[r * n_links + 2 * h + d for r in range(rails) for d in (0, 1)] for h in range(hosts)]
    return Network(hosts, cap, names, routes, host_links)


def congest_links(net: Network, links: dict[int, float]) -> Network:
    """The same network with some links' capacity set (bytes/s)."""
    cap = net.capacity.copy()
    for link, bps in links.items():
        cap[link] = bps
    out = replace(net, capacity=cap)
    out.__dict__["path_links"] = net.path_links  # same routes: reuse the cached array
    return out


def congest_pair(net: Network, a: int, b: int, bps: float) -> Network:
    """Traffic between hosts a and b (both ways) limited to `bps`, the rest untouched (htb + a u32 filter per host)."""
    cap, names, routes = list(net.capacity), list(net.names), dict(net.routes)
    for src, dst in ((a, b), (b, a)):
        names.append(f"pair {src}->{dst}")
        cap.append(bps)
        routes[src, dst] = [path + (len(cap) - 1,) for path in routes[src, dst]]
    return replace(net, capacity=np.array(cap), names=names, routes=routes)


def phase_time(net: Network, phase: Phase, alpha_s: float) -> float:
    if not phase.transfers:
        return phase.steps * alpha_s
    src, dst, nbytes = (np.array(col) for col in zip(*phase.transfers))
    links = net.path_links[src.astype(int), dst.astype(int)]  # [transfer, path, hop]
    per_path = np.broadcast_to((nbytes / links.shape[1])[:, None, None], links.shape)
    load = np.zeros(len(net.capacity) + 1)
    np.add.at(load, links.ravel(), per_path.ravel())
    return phase.steps * alpha_s + float(np.max(load[:-1] / net.capacity))


def plan_time(net: Network, plan: list[Phase], alpha_s: float) -> float:
    return sum(phase_time(net, p, alpha_s) for p in plan)


def ring(order: list[int], size: float) -> list[Phase]:
    """Ring all-reduce: reduce-scatter then all-gather, each host sending 2(n-1)/n of the data to its successor."""
    n = len(order)
    hop = 2 * (n - 1) / n * size
    return [Phase([(order[i], order[(i + 1) % n], hop) for i in range(n)], 2 * (n - 1))]


def leaf_tree(core: list[int], parents: dict[int, int], size: float, *, pipelined: bool = True) -> list[Phase]:
    """Slow hosts as leaves: each sends its data to a parent once and gets the result back once, and the other hosts
    all-reduce in a ring. Pipelined (chunks flow up and down at once) it is one phase; otherwise three."""
    up = [(leaf, p, size) for leaf, p in parents.items()]
    down = [(p, leaf, size) for leaf, p in parents.items()]
    inner = ring(core, size)[0] if len(core) > 1 else Phase([], 0)
    if pipelined:
        return [Phase(up + inner.transfers + down, inner.steps + 2)]
    return [Phase(up, 1), inner, Phase(down, 1)]


def _ring_avoiding(rates: np.ndarray, hosts: list[int], threshold: float) -> list[int] | None:
    """A ring over `hosts` whose every hop runs at >= threshold, staying close to their native order; None if the
    greedy search (from a few starting hosts) finds none."""
    for start in hosts[:4]:
        order, left = [start], [h for h in hosts if h != start]
        while left:
            nxt = next((h for h in left if rates[order[-1], h] >= threshold), None)
            if nxt is None:
                break
            order.append(nxt)
            left.remove(nxt)
        if not left and rates[order[-1], order[0]] >= threshold:
            return order
    return None


def best_ring(net: Network, hosts: list[int]) -> list[int]:
    """The ring whose slowest hop is fastest: a binary search over the hop rates for the highest one the greedy
    search can keep every hop at."""
    if len(hosts) < 3:
        return list(hosts)
    rates = net.hop_rates()
    levels = np.unique(rates[np.ix_(hosts, hosts)][~np.eye(len(hosts), dtype=bool)])  # ascending
    lo, hi, found = 0, len(levels) - 1, list(hosts)
    while lo <= hi:
        mid = (lo + hi) // 2
        order = _ring_avoiding(rates, hosts, levels[mid])
        if order is None:
            hi = mid - 1
        else:
            found, lo = order, mid + 1
    return found


def candidate_plans(net: Network, size: float) -> dict[str, list[Phase]]:
    """The plans an adaptive planner weighs: the native ring, the best reordered ring, and (when some hosts' own
    links are slow) trees with those hosts as leaves."""
    everyone = list(range(net.hosts))
    plans = {"native ring": ring(everyone, size), "reordered ring": ring(best_ring(net, everyone), size)}
    own = np.array([net.capacity[links].min() for links in net.host_links])
    slow = [h for h in everyone if own[h] < 0.9 * own.max()]
    if slow and len(slow) <= net.hosts // 2:
        core = best_ring(net, [h for h in everyone if h not in slow])
        parents = {leaf: core[i % len(core)] for i, leaf in enumerate(slow)}
        plans["leaf tree (pipelined)"] = leaf_tree(core, parents, size, pipelined=True)
        plans["leaf tree (reduce, ring, broadcast)"] = leaf_tree(core, parents, size, pipelined=False)
    return plans


def compare_plans(net: Network, size: float, alpha_s: float) -> dict[str, float]:
    """Seconds per all-reduce of `size` bytes, per candidate plan."""
    return {name: plan_time(net, plan, alpha_s) for name, plan in candidate_plans(net, size).items()}


def build(topology: str, *, hosts: int, host_bps: float, hosts_per_leaf: int = 8, spines: int = 4,
          rails_per_host: int = 8) -> Network:
    if topology == "star":
        return star(hosts=hosts, host_bps=host_bps)
    if topology == "fat-tree":
        return fat_tree(hosts=hosts, host_bps=host_bps, hosts_per_leaf=hosts_per_leaf, spines=spines)
    return rails(hosts=hosts, host_bps=host_bps, rails=rails_per_host)


def sweep(net: Network, *, size: float, alpha_s: float, congested: int, keep: tuple[float, float],
          trials: int, seed: int) -> list[dict]:
    """`trials` draws of `congested` random links each left with a uniform fraction in `keep` of their capacity;
    per draw: the native and adaptive (best candidate) times, the plan chosen and the algbw gain."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(trials):
        links = rng.choice(len(net.capacity), size=congested, replace=False)
        slowed = congest_links(net, {int(k): net.capacity[k] * rng.uniform(*keep) for k in links})
        times = compare_plans(slowed, size, alpha_s)
        best = min(times, key=times.__getitem__)
        rows.append({"links": [net.names[k] for k in links], "native_s": times["native ring"],
                     "adaptive_s": times[best], "plan": best, "gain": times["native ring"] / times[best]})
    return rows


def testbed_predictions(*, hosts: int = 4, host_bps: float = TESTBED_HOST_BPS, shaped_mbit: float = 200.0,
                        sizes: tuple[int, ...] = (2**20, 16 * 2**20, 64 * 2**20), alpha_s: float = 5e-4) -> list[dict]:
    """What `dtk bench comm --testbed N` should measure for all-reduce: no shaping, pair 0-1 shaped, host 0 shaped
    (both ways), per size and plan. Rates are payload rates: a shaped link carries PAYLOAD_PER_FRAME of its rate."""
    shaped = shaped_mbit * 1e6 / 8 * PAYLOAD_PER_FRAME
    base = star(hosts=hosts, host_bps=host_bps)
    cases = {"none": base, f"pair=0-1,rate={shaped_mbit:g}mbit": congest_pair(base, 0, 1, shaped),
             f"host=0,rate={shaped_mbit:g}mbit": congest_links(base, {link: shaped for link in base.host_links[0]})}
    rows = []
    for case, net in cases.items():
        for size in sizes:
            times = compare_plans(net, size, alpha_s)
            best = min(times, key=times.__getitem__)
            for plan, t in times.items():
                rows.append({"congest": case, "size_bytes": size, "plan": plan, "time_s": t,
                             "algbw_gbps": size / t / 1e9, "gain_vs_native": times["native ring"] / t,
                             "chosen": plan == best})
    return rows
