"""`dtk bench comm` as a user runs it: 2 real gloo ranks, native and seam rows for every collective and size."""
from __future__ import annotations

import json

import pytest

from tests.conftest import run_dtk

pytestmark = pytest.mark.dist

SIZES = [4096, 8192, 16384, 32768, 65536]  # 4K..64K, doubling
FACTORS = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5}  # busbw / algbw at n = 2


@pytest.mark.timeout(180)
def test_sweep_writes_native_and_seam_rows(tmp_path):
    out = tmp_path / "out.json"
    p = run_dtk("bench", "comm", "--nproc", "2", "--max-bytes", "64K", "--iters", "2", "--json", out, timeout=170)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "seam/native" in p.stdout

    report = json.loads(out.read_text())
    rows = {(r["op"], r["size_bytes"]): r for r in report["rows"]}
    assert set(rows) == {(op, size) for op in FACTORS for size in SIZES}
    for (op, size), row in rows.items():
        for side in ("native", "seam"):
            m = row[side]
            assert m["time_s"] > 0 and m["algbw_gbps"] > 0 and m["busbw_gbps"] > 0
            assert m["algbw_gbps"] == pytest.approx(size / m["time_s"] / 1e9, rel=1e-9)
            assert m["busbw_gbps"] == pytest.approx(m["algbw_gbps"] * FACTORS[op], rel=1e-12)
        # the seam counts each call at nccl-tests' size (all-gather: output, reduce-scatter: input)
        assert row["seam_counted_size_bytes"] == size


@pytest.mark.timeout(180)
def test_bad_size_is_one_line_error():
    p = run_dtk("bench", "comm", "--max-bytes", "12Q", timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip() == "error: --max-bytes: got '12Q'; accepted: a size like 4K, 1M, 64M"
