"""resilience.parity_group / parity_tier2: defaults and the one-line errors for pairs that do not fit the world."""
from __future__ import annotations

import pytest

from dtk import recipe
from dtk.errors import DtkError
from dtk.resilience.parity import parity_layout


def _res(*overrides: str):
    return recipe.build({}, list(overrides)).resilience


def test_defaults_to_the_ranks_of_a_node_and_no_tier2():
    assert parity_layout(_res(), world=8, nproc_per_node=4) == (4, 0)
    assert parity_layout(_res(), world=4, nproc_per_node=1) == (2, 0)  # at least 2
    assert parity_layout(_res("resilience.parity_group=2", "resilience.parity_tier2=1"), world=4,
                         nproc_per_node=4) == (2, 1)


@pytest.mark.parametrize("overrides,world,field,accepted", [
    (["resilience.parity_group=3"], 4, "resilience.parity_group: got 3", "accepted: 2, 4"),
    (["resilience.parity_tier2=1"], 4, "resilience.parity_tier2: got 1", "accepted: 0..0"),
    (["resilience.parity_group=2", "resilience.parity_tier2=2"], 4, "resilience.parity_tier2: got 2",
     "accepted: 0..1"),
])
def test_pairs_that_do_not_fit_name_the_field(overrides, world, field, accepted):
    with pytest.raises(DtkError) as e:
        parity_layout(_res(*overrides), world=world, nproc_per_node=world)
    assert field in e.value.lines[0] and accepted in e.value.lines[0]


def test_recipe_rejects_a_group_of_one():
    with pytest.raises(DtkError, match="resilience.parity_group"):
        _res("resilience.parity_group=1")


def test_commit_rule_picks_the_newest_step_usable_everywhere():
    from dtk.resilience.parity import ParityLost, agree_step

    # nobody saw the vote of 6 complete: rank 0 finished its exchange of 6, rank 2 did not
    assert agree_step({0: [5, 6], 2: [5, -1]}, lost={1}) == 5
    # rank 0 saw the vote of 6 complete (its slot of 5 is still there); rank 2 finished 6 but missed the vote
    assert agree_step({0: [6, 5], 2: [5, 6]}, lost={1}) == 6
    # rank 0 moved on and overwrote 5 with its (failed) exchange of 7; 6 is what both still hold
    assert agree_step({0: [6, -1], 2: [5, 6]}, lost={1}) == 6
    with pytest.raises(ParityLost, match="no step boundary"):
        agree_step({0: [7, -1], 2: [5, -1]}, lost={1})
