"""The comm planner's decisions from measured link rates: what it picks for a congested path, a congested host,
no congestion (native) and noise; and that every change needs evidence and hysteresis."""
from __future__ import annotations

import pytest

from dtk.comm.planner import KINDS, NATIVE, Links, PlanState, choose, native_vranks, seconds
from dtk.testbed import shape
from dtk.errors import DtkError

FAST, SLOW = 2e8, 2.5e7  # bytes/s: a healthy veth path, a 200 mbit one


def matrix(p: int, slow_pairs=(), slow_hosts=(), noise=None) -> list[list[float]]:
    m = [[FAST * (noise[i][j] if noise else 1.0) for j in range(p)] for i in range(p)]
    for i, j in slow_pairs:
        m[i][j] = m[j][i] = SLOW
    for h in slow_hosts:
        for j in range(p):
            m[h][j] = m[j][h] = SLOW
    return m


def edges(order):
    return {frozenset((order[k], order[(k + 1) % len(order)])) for k in range(len(order))}


def test_no_congestion_keeps_native_even_with_noise():
    noise = [[1.0, 0.5, 1.7, 0.6], [0.9, 1.0, 0.4, 1.3], [1.1, 2.0, 1.0, 0.7], [0.5, 1.2, 0.8, 1.0]]
    links = Links(matrix(4, noise=noise))
    assert links.congested == []
    for kind in KINDS:
        assert choose(links, kind) == NATIVE


def test_congested_pair_gets_a_ring_that_avoids_it():
    links = Links(matrix(4, slow_pairs=[(0, 1)]))
    assert [(i, j) for i, j, _ in links.congested] == [(0, 1)]
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        c = choose(links, kind)
        assert c.algo == "reordered" and frozenset((0, 1)) not in edges(c.order)
        assert seconds(links, kind, c, 8 << 20) < 0.2 * seconds(links, kind, NATIVE, 8 << 20)


def test_congested_host_becomes_a_leaf_with_the_result_on_another_connection():
    links = Links(matrix(4, slow_hosts=[2]))
    c = choose(links, "all_reduce")
    assert c.algo == "leaf"
    leaf_group = next(g for g in c.groups if len(g) == 2)
    assert leaf_group[1] == 2 and sorted(r for g in c.groups for r in g) == [0, 1, 2, 3]
    (member, back), = c.back
    assert member == 2 and back not in (2, leaf_group[0])
    ratio = seconds(links, "all_reduce", NATIVE, 16 << 20) / seconds(links, "all_reduce", c, 16 << 20)
    assert ratio > 1.3  # the bound is 2(p-1)/p = 1.5: the host moves S each way instead of 1.5 S
    assert choose(links, "all_gather") == NATIVE  # every ring crosses the host's link the same


def test_plan_changes_with_evidence_and_returns_to_native_only_after_clean_probes():
    state = PlanState()
    d = state.update(matrix(4, slow_pairs=[(1, 2)]), reason="test")
    assert set(d.changed) == set(KINDS)
    assert d.evidence["congested_links"][0]["link"] == "1-2"
    again = state.update(matrix(4, slow_pairs=[(1, 2)]), reason="test")
    assert again.changed == []  # same evidence, same plan
    first_clean = state.update(matrix(4), reason="test")
    assert first_clean.changed == [] and state.plan["all_reduce"] != NATIVE
    second_clean = state.update(matrix(4), reason="test")
    assert set(second_clean.changed) == set(KINDS)
    assert all(c == NATIVE for c in state.plan.values())


def tree_edges(vranks):
    """gloo's binomial broadcast: virtual rank v < 2^i sends to v + 2^i in round i."""
    p, out, step = len(vranks), set(), 1
    while step < p:
        out |= {frozenset((vranks[v], vranks[v + step])) for v in range(min(step, p - step))}
        step *= 2
    return out


@pytest.mark.parametrize("p", [4, 5, 8])  # 8: above TREE_SEARCH, the greedy numbering
def test_congested_pair_keeps_every_roots_broadcast_tree_off_it(p):
    links = Links(matrix(p, slow_pairs=[(0, 1)]))
    c = choose(links, "broadcast")
    assert c.algo == "reordered" and len(c.roots) == p
    for root, numbering in enumerate(c.roots):
        vranks = numbering or native_vranks(p, root)  # () keeps the native numbering, rotated to the root
        assert vranks[0] == root and sorted(vranks) == list(range(p))
        assert frozenset((0, 1)) not in tree_edges(vranks), (root, vranks)
    assert seconds(links, "broadcast", c, 8 << 20) < seconds(links, "broadcast", NATIVE, 8 << 20)


def test_congested_pair_reduces_to_its_ends_by_an_all_reduce_and_to_the_others_on_a_better_ring():
    """gloo's reduce is a ring reduce-scatter, then every rank sends its chunk straight to the root: a renumbered
    ring avoids the pair in the first part only, so the pair's own ends are served by an all-reduce instead."""
    links = Links(matrix(4, slow_pairs=[(0, 1)]))
    c = choose(links, "reduce")
    assert c.algo == "reordered" and frozenset((0, 1)) not in edges(c.order)
    assert c.via_all_reduce == (0, 1)
    assert seconds(links, "reduce", c, 8 << 20) < 0.3 * seconds(links, "reduce", NATIVE, 8 << 20)


@pytest.mark.parametrize("spec, message", [
    ("pair=0-0,rate=1mbit", "two different ones for a pair"),
    ("pair=0-1,rate=fast", "accepted: a tc rate like 200mbit"),
    ("host=1,pair=0-1,rate=1mbit", "exactly one of host=I or pair=I-J"),
    ("host=9,rate=1mbit", "accepted hosts: 0..3"),
    ("link=1,rate=1mbit", "accepted keys: host=I or pair=I-J"),
])
def test_bad_congestion_specs_are_one_line_errors(spec, message):
    with pytest.raises(DtkError) as e:
        shape.parse(spec, hosts=4)
    assert len(e.value.lines) == 1 and message in e.value.lines[0] and spec in e.value.lines[0]
