"""Sharded state survives a lost rank: FSDP and DeepSpeed ZeRO ranks on 3 ranks (an odd count) lose a rank in each
phase of a step and to each kind of failure; the lost shard is rebuilt from the survivors' XOR parity (tier 1), or
a whole parity group from Reed-Solomon parity (tier 2), and the run ends with the losses of the run without
failures, compared with ==."""
from __future__ import annotations

import json

import pytest

from conftest import RECIPES, TINY, losses, run_dtk, train

pytestmark = [pytest.mark.dist]


def _inject(run_dir, *args, timeout=540):
    p = run_dtk("inject-failure", RECIPES / "quickstart.yaml", *TINY, "resilience.mode=inplace",
                f"output.dir={run_dir}", *args, "--no-progress", timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_lost_shards_are_rebuilt_from_parity_in_every_phase(tmp_path, strategy):
    three = ["world.nproc=3", "training.steps=18", "training.seed=3", f"strategy.name={strategy}"]
    ref = losses(train(tmp_path / "ref", *three))
    summary = _inject(tmp_path / "chaos", *three, "resilience.shadows=2", "resilience.max_failures=10",
                      "--fault", "kill:rank=1,step=4", "--fault", "segv:rank=2,step=8,phase=backward",
                      "--fault", "hang:rank=0,step=11,phase=optimizer", "--fault", "corrupt:rank=1,step=14")
    assert losses(tmp_path / "chaos") == ref
    failures = summary["failures"]
    assert [(f["fault"], f["rank"]) for f in failures] == [("kill", 1), ("segv", 2), ("hang", 0), ("corrupt", 1)]
    for f in failures:
        assert f["rebuilt_from"] == "parity tier 1", f
        assert f["repair_bytes"] > 0 and f["steps_lost"] in (0, 1)
        assert [r["replacement"] for r in f["replacements"]] == ["shadow"]
    parity = summary["parity"]
    # RAID-5 in one group of 3: each rank holds 1/(k-1) = 1/2 of its local state as parity (plus padding)
    assert 0.5 <= parity["parity_bytes_per_rank"] / parity["local_state_bytes"] < 0.51


@pytest.mark.timeout(600)
def test_a_whole_parity_group_lost_at_once_is_rebuilt_from_tier_two(tmp_path):
    four = ["world.nproc=4", "training.steps=10", "strategy.name=zero2", "resilience.parity_group=2",
            "resilience.parity_tier2=1"]
    ref = losses(train(tmp_path / "ref", *four))
    summary = _inject(tmp_path / "node", *four, "resilience.shadows=2",
                      "--fault", "kill:rank=0,step=5", "--fault", "kill:rank=1,step=5")
    assert losses(tmp_path / "node") == ref
    assert {f["rank"] for f in summary["failures"]} == {0, 1}
    assert {f["rebuilt_from"] for f in summary["failures"]} == {"parity tier 2"}
