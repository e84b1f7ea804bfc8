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
