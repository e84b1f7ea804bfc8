"""The DeepSpeed config dtk builds from a recipe, without processes: what it sets where DeepSpeed's defaults would
make ZeRO differ from the other strategies (buckets, clipping, precision)."""
from __future__ import annotations

import pytest

from dtk import recipe
from dtk.strategies.zero import deepspeed_config


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("overrides, elements", [
    ([], 25 * 2**20 // 4),                                    # strategy.bucket_mb's 25 MiB of fp32 gradients
    (["training.precision=bf16"], 25 * 2**20 // 2),           # of bf16 ones: DeepSpeed reduces in the model dtype
    (["strategy.bucket_mb=1"], 2**18),
    (["strategy.bucket_mb=0.000001"], 1),                     # never a bucket of 0 elements (DeepSpeed refuses it)
])
def test_buckets_follow_strategy_bucket_mb_not_deepspeeds_2gb_default(stage, overrides, elements):
    zero = deepspeed_config(recipe.build({}, [f"strategy.name=zero{stage}", *overrides]), stage=stage)["zero_optimization"]
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == elements
    if stage == 3:  # the optimizer steps ZeRO-3's partition a bucket at a time
        assert zero["sub_group_size"] == elements


def test_precision_and_clipping_reach_deepspeed():
    config = deepspeed_config(recipe.build({}, ["strategy.name=zero3", "training.precision=bf16"]), stage=3)
    assert config["bf16"] == {"enabled": True} and config["gradient_clipping"] == 0  # DeepSpeed's default clips at 1
    assert not deepspeed_config(recipe.build({}, ["strategy.name=zero3"]), stage=3)["bf16"]["enabled"]
