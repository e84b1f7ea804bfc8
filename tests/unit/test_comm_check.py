"""A plan change checked against what it delivers: kept when it delivers its promised gain, undone when it falls far
short, decided on every rank's merged figures, and an undone plan not picked again on the same evidence until its
bar lapses (longer each time)."""
from __future__ import annotations

from dtk.comm.check import CHECK_CALLS, PlanCheck
from dtk.comm.planner import NATIVE, UNDONE_PROBES, Choice, Links, PlanState, choose, seconds
from tests.unit.test_comm_planner import matrix

MB8 = 8 << 20
LINKS = Links(matrix(4, slow_pairs=[(0, 1)]))
RING = choose(LINKS, "all_reduce")
OLD_S, NEW_S = seconds(LINKS, "all_reduce", NATIVE, MB8), seconds(LINKS, "all_reduce", RING, MB8)


def check(before_s: float | None, after_s: float, calls: int = CHECK_CALLS, new=RING) -> PlanCheck:
    return PlanCheck(kind="all_reduce", old=NATIVE, new=new, links=LINKS, step=3,
                     before=[(MB8, before_s)] * 3 if before_s is not None else [], after=[(MB8, after_s)] * calls)


def merged(*checks: PlanCheck) -> list[float]:
    """What the router's MAX all-reduce makes of every rank's figures."""
    return [max(xs) for xs in zip(*(c.figures() for c in checks))]


def test_a_plan_that_delivers_its_promise_is_kept():
    assert RING != NATIVE and OLD_S > 2 * NEW_S  # the model promises most of the old time
    v = check(OLD_S, NEW_S).verdict(merged(check(OLD_S, NEW_S)))
    assert v["verdict"] == "kept" and v["calls"] == CHECK_CALLS
    assert v["predicted_gain_s"] == round(OLD_S - NEW_S, 6) == v["delivered_gain_s"]
    assert v["predicted_s"] == round(NEW_S, 6) and v["before_measured_s"] == round(OLD_S, 6)


def test_a_plan_far_short_of_its_promise_is_undone():
    slow = check(OLD_S, 0.9 * OLD_S)  # delivered a tenth of the old time; promised most of it
    v = slow.verdict(merged(slow))
    assert v["verdict"] == "undone" and v["delivered_gain_s"] < 0.5 * v["predicted_gain_s"]


def test_ranks_decide_on_the_fewest_calls_and_the_slowest_rank():
    fast, short_of_calls = check(OLD_S, NEW_S), check(OLD_S, NEW_S, calls=CHECK_CALLS - 1)
    assert fast.verdict(merged(fast, short_of_calls)) is None  # not due until every rank has timed enough calls
    lagging = check(OLD_S, 0.9 * OLD_S)
    for rank_view in (fast, lagging):  # the same merged figures give every rank the same verdict
        v = rank_view.verdict(merged(fast, lagging))
        assert v["verdict"] == "undone" and v["measured_s"] == round(0.9 * OLD_S, 6)


def test_without_old_calls_the_old_plan_is_the_models():
    v = check(None, 0.9 * OLD_S).verdict(merged(check(None, 0.9 * OLD_S)))
    assert v["before_measured_s"] is None and v["verdict"] == "undone"
    assert v["delivered_gain_s"] == round(OLD_S - 0.9 * OLD_S, 6)


def test_calls_below_the_plans_size_promise_nothing_and_are_kept():
    big_only = Choice(algo=RING.algo, order=RING.order, min_bytes=2 * MB8)
    c = check(OLD_S, 2 * OLD_S, new=big_only)
    assert c.verdict(merged(c))["verdict"] == "nothing promised"


def test_an_undone_plan_is_barred_on_the_same_evidence_longer_each_time():
    congested = matrix(4, slow_pairs=[(0, 1)])
    state = PlanState()
    d = state.update(congested, reason="test")
    assert state.plan["all_reduce"] == RING
    for times in (1, 2):
        state.undo("all_reduce", to=NATIVE, links=d.links)
        for _ in range(UNDONE_PROBES * 2 ** (times - 1)):
            held = state.update(congested, reason="test")
            assert held.changed == [] and state.plan["all_reduce"] == NATIVE
            assert "all_reduce" in held.evidence["held_back"]
        again = state.update(congested, reason="test")  # the bar lapsed: tried again
        assert again.changed == ["all_reduce"] and state.plan["all_reduce"] == RING
    state.undo("all_reduce", to=NATIVE, links=d.links)
    other = state.update(matrix(4, slow_pairs=[(2, 3)]), reason="test")  # new evidence: no bar
    assert "all_reduce" in other.changed and state.plan["all_reduce"] != NATIVE
