"""resilience.protect_every: the interval `auto` picks (Young/Daly), the recipe's one-line errors, and the algebra the
keeper's delta protection rests on (parity of a delta updates the parity of the state, for both tiers)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from dtk import recipe
from dtk.errors import DtkError
from dtk.resilience.erasure import RSLayout, XorLayout
from dtk.resilience.schedule import DEFAULT_MTBF_S, ProtectSchedule


def test_auto_follows_young_daly_and_a_fixed_interval_stays():
    auto = ProtectSchedule(every="auto", mtbf_s=5000.0)
    auto.observe(cost_s=0.02, step_s=0.0)  # the protection before the first step: nothing to weigh it against
    assert auto.interval == 1
    auto.observe(cost_s=0.02, step_s=0.25)
    assert auto.interval == round(math.sqrt(2 * 0.02 * 5000) / 0.25) == 57
    assert "Young/Daly" in auto.figures()["why"] and auto.figures()["protect_interval"] == 57
    auto.observe(cost_s=1e-9, step_s=10.0)
    assert auto.interval == 1  # never less than every step
    auto.adopt(9)  # a replacement takes the survivors' interval
    assert auto.interval == 9
    fixed = ProtectSchedule(every=4, mtbf_s=DEFAULT_MTBF_S)
    fixed.observe(cost_s=5.0, step_s=0.1)
    fixed.adopt(9)
    assert fixed.interval == 4 and fixed.figures()["why"] == "every 4 steps, as the recipe asks"
    assert 6000 < DEFAULT_MTBF_S < 7000


def test_recipe_accepts_auto_or_steps_and_says_so_in_one_line():
    r = recipe.build({}, ["resilience.protect_every=auto", "resilience.mtbf_s=3600"]).resilience
    assert (r.protect_every, r.mtbf_s) == ("auto", 3600.0)
    assert recipe.build({}, []).resilience.protect_every == 1
    for bad in ("0", "fast", "2.5"):
        with pytest.raises(DtkError) as e:
            recipe.build({}, [f"resilience.protect_every={bad}"])
        assert e.value.lines == [f"resilience.protect_every: got {bad if bad != 'fast' else repr(bad)}; "
                                 f"accepted: auto, or a number of steps >= 1"]


def test_parity_of_a_delta_turns_the_old_parity_into_the_new():
    """stripe(T) ^ stripe(T ^ T') == stripe(T'), for XOR and for Reed-Solomon (linear over GF(2^8))."""
    rng = np.random.default_rng(5)
    sizes = [1000, 937, 1000, 64]
    old = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    new = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    delta = [a ^ b for a, b in zip(old, new)]
    xor = XorLayout.for_state(k=4, state_bytes=1000)
    for p_old, p_delta, p_new in zip(xor.encode(old), xor.encode(delta), xor.encode(new)):
        assert np.array_equal(p_old ^ p_delta, p_new)
    rs = RSLayout.for_state(groups=4, m=2, state_bytes=1000)
    codec = rs.codec()
    for p_old, p_delta, p_new in zip(rs.encode(old, codec), rs.encode(delta, codec), rs.encode(new, codec)):
        assert np.array_equal(p_old ^ p_delta, p_new)
