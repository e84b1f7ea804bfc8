"""A multi-node run whose other host never starts: node 0 names that node (and its ranks) within world.timeout_s,
in one line, instead of a collective timeout at step 0."""
from __future__ import annotations

import pytest

from conftest import RECIPES, TINY, run_dtk
from dtk.rendezvous import free_port

pytestmark = [pytest.mark.e2e]


@pytest.mark.timeout(120)
def test_a_node_that_never_joins_is_named_within_the_timeout(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    p = run_dtk("train", RECIPES / "quickstart.yaml", *TINY, "training.steps=5", "world.timeout_s=6",
                f"output.dir={tmp_path / 'run'}", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", endpoint,
                "--no-progress", timeout=100)
    assert p.returncode == 1, p.stdout + p.stderr
    errors = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert errors and "node 1 (ranks 2-3) never joined the rendezvous" in errors[0], p.stderr
    assert "world.timeout_s=6s" in errors[0]
