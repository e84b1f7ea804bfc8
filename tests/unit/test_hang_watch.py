"""The hang watch reads how long each rank has been still from its own beats (torch's in-process HashStore stands
for the run's store): a hang is declared within the timeout of the rank's last progress, the watch's poll included,
and never while a peer still moves on."""
from __future__ import annotations

import json

import torch.distributed as dist

from dtk.resilience import protocol as keys
from dtk.resilience.watches import HangWatch


def _beat(store: dist.Store, rank: int, *, still_s: float, outstanding: int, t: float, phase: str = "train") -> None:
    store.set(keys.beat(rank), json.dumps({"step": 7, "t": t, "outstanding": outstanding, "phase": phase,
                                           "still_s": still_s, "step_s": 0.1, "token": f"host:{rank}"}))


def _check(watch: HangWatch, store: dist.Store) -> list[int]:
    watch._next_poll = 0.0  # each call is one poll
    return watch.check(store, [0, 1, 2])


def test_a_hang_is_declared_a_beat_and_a_poll_before_the_timeout_and_only_the_idle_rank_is_blamed():
    store = dist.HashStore()
    watch = HangWatch(fixed_s=5.0)
    for t, still in enumerate([4.2, 4.45]):  # more than a beat and a poll before the timeout: not yet
        for r in range(3):
            _beat(store, r, still_s=still, outstanding=0 if r == 1 else 1, t=float(t))
        assert _check(watch, store) == []
    for r in range(3):  # the beat may be 0.25 s old and the next poll 0.25 s later: declare it now
        _beat(store, r, still_s=4.55, outstanding=0 if r == 1 else 1, t=2.0)
    assert _check(watch, store) == [1]
    assert _check(watch, store) == []  # once


def test_a_peer_that_moves_on_or_a_long_phase_keeps_the_others_from_being_called_hung():
    store = dist.HashStore()
    watch = HangWatch(fixed_s=None)
    watch.step_times.extend([0.1] * 10)  # the automatic timeout is its floor, 5 s
    for t in (0.5, 1.0):  # the second beat shows each writer alive: their still_s hold
        for r in range(3):
            _beat(store, r, still_s=0.2 if r == 0 else 30.0, outstanding=0 if r == 1 else 1, t=t)
        assert _check(watch, store) == []  # rank 0 still steps: rank 1 is slow, not hung
    for r in range(3):
        _beat(store, r, still_s=30.0, outstanding=0, t=2.0, phase="checkpoint" if r == 2 else "train")
    assert _check(watch, store) == []  # a save may take a minute
    for r in range(3):
        _beat(store, r, still_s=30.0, outstanding=0 if r == 1 else 1, t=3.0)
    assert _check(watch, store) == [1]


def test_a_replacement_is_not_blamed_for_the_hang_of_the_process_it_replaced():
    """CI hung on this: rank 1 hung, was killed and replaced; its last beat (still for seconds, nothing outstanding)
    was still the rank's beat when the watch, reset for the replacement, polled at once, with the others stalled
    behind the hang: the watch blamed rank 1 again and killed the replacement as it joined, round after round."""
    store = dist.HashStore()
    watch = HangWatch(fixed_s=5.0)
    _beat(store, 1, still_s=5.0, outstanding=0, t=2.0)  # the hung process's last beat, before it was killed
    watch.reset()  # rank 1 replaced; its predecessor's last beat stays until the replacement beats
    for r in (0, 2):
        _beat(store, r, still_s=5.2, outstanding=1, t=3.0)
    assert _check(watch, store) == []  # rank 1's beat is the dead process's: not taken at its word
    for r in (0, 2):
        _beat(store, r, still_s=5.4, outstanding=1, t=4.0)
    assert _check(watch, store) == []  # the others' still_s hold now, rank 1's old beat still does not
    _beat(store, 1, still_s=0.1, outstanding=0, t=4.1)  # the replacement's first beat: it has just started
    assert _check(watch, store) == []
