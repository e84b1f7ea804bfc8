"""What parity costs: encode GB/s of tier 1 (XOR) and tier 2 (Reed-Solomon, per pyeclib backend) in one process;
parity memory per rank / local state for k = 2, 3, 4; and on real gloo ranks, one parity exchange (protect) and one
rebuild of a lost rank for a ~50 MB state, side by side with a DCP save of the same state, in one run.

    python benchmarks/parity.py [--state-mb 50] [--reps 5] [--codec-mb 8] [--configs 3:3:0,4:2:1]
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtk.resilience.erasure import EC_TYPES, RSCodec, RSLayout, XorLayout  # noqa: E402


def _best_median(fn, reps: int) -> tuple[float, float]:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def codec_rows(mb: float, reps: int) -> list[dict]:
    rng = np.random.default_rng(0)
    size = int(mb * (1 << 20))
    rows = []
    for k in (2, 3, 4):
        layout = XorLayout.for_state(k=k, state_bytes=size)
        datas = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(k)]
        best, med = _best_median(lambda: layout.encode(datas), reps)
        rows.append({"tier": 1, "code": f"xor k={k}", "input_bytes": k * size,
                     "gbps_best": k * size / best / 1e9, "gbps_median": k * size / med / 1e9})
    for ec_type in EC_TYPES:
        for kd, m in ((1, 1), (2, 1), (3, 1), (2, 2)):
            chunk = -(-size // kd // 64) * 64
            try:
                codec = RSCodec(k=kd, m=m, chunk=chunk, ec_type=ec_type)
            except Exception as e:  # a backend this build lacks
                rows.append({"tier": 2, "code": f"{ec_type} {kd}+{m}", "error": str(e)[:80]})
                continue
            data = [rng.integers(0, 256, chunk, dtype=np.uint8) for _ in range(kd)]
            best, med = _best_median(lambda: codec.encode(data), reps)
            shards = dict(enumerate(data + codec.encode(data)))
            for i in range(m):  # decode with the first m data shards lost
                shards.pop(i, None)
            dbest, dmed = _best_median(lambda: codec.decode(shards), reps)
            n = kd * chunk
            rows.append({"tier": 2, "code": f"{ec_type} {kd}+{m}", "input_bytes": n,
                         "gbps_best": n / best / 1e9, "gbps_median": n / med / 1e9,
                         "decode_gbps_median": n / dmed / 1e9})
    return rows


def memory_rows(state_bytes: int) -> list[dict]:
    rows = []
    for k in (2, 3, 4):
        c = XorLayout.for_state(k=k, state_bytes=state_bytes).chunk
        rows.append({"tier": 1, "layout": f"k={k}", "parity_bytes": c, "ratio": c / state_bytes,
                     "expected": 1 / (k - 1)})
    for g, m in ((2, 1), (3, 1), (4, 1), (4, 2)):
        c = RSLayout.for_state(groups=g, m=m, state_bytes=state_bytes).chunk * m
        rows.append({"tier": 2, "layout": f"G={g} m={m}", "parity_bytes": c, "ratio": c / state_bytes,
                     "expected": m / (g - m)})
    return rows


def _exchange_rank(rank, nproc, port, queue, state_mb, group_size, tier2, reps, tmp):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dtk.comm.group import Seam, register
    from dtk.resilience.parity import ParityKeeper

    torch.set_num_threads(1)
    register()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=600))
    dist.init_process_group("dtk", store=dist.PrefixStore("w", store), rank=rank, world_size=nproc,
                            timeout=datetime.timedelta(seconds=600))
    n = int(state_mb * (1 << 20)) // 4 // 3  # params + two Adam moments, fp32, and a step counter
    g = torch.Generator().manual_seed(rank)
    state = [torch.randn(n, generator=g) for _ in range(3)] + [torch.tensor(1.0)]
    keeper = ParityKeeper(state=lambda: state, group_size=group_size, tier2=tier2)
    rows = {"protect": [], "dcp_save": [], "rebuild": []}
    for step in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        keeper.protect(step)
        assert keeper.wait_current()
        seconds = time.perf_counter() - t0
        if step:  # the first one also agrees the layout and allocates the staging buffer
            rows["protect"].append({"seconds": seconds, **{k: v for k, v in vars(keeper.stats).items()
                                                            if k != "totals"}})
        dist.barrier()
        t0 = time.perf_counter()
        with Seam.uncounted():
            dcp.save({f"r{rank}": {str(i): t for i, t in enumerate(state)}}, checkpoint_id=f"{tmp}/s{step}")
        if step:
            rows["dcp_save"].append({"seconds": time.perf_counter() - t0})
    lost = [nproc - 1] if not tier2 else list(range(nproc - group_size, nproc))
    for _ in range(max(1, reps // 2)):
        expected = [t.clone() for t in state]
        if rank in lost:
            for t in state:
                t.zero_()
        dist.barrier()
        report = keeper.recover(lost)
        assert keeper.wait_current()
        assert all(torch.equal(a, b) for a, b in zip(state, expected))
        rows["rebuild"].append(vars(report))
    out = {"rank": rank, "state_bytes": keeper.state_bytes, "parity_bytes_per_rank": keeper.parity_bytes_per_rank,
           "memory_bytes": keeper.memory_bytes,
           "peak_memory_bytes": keeper.peak_memory_bytes, "ec_type": keeper.codec.ec_type if keeper.codec else None, **rows}
    gathered = [None] * nproc
    dist.all_gather_object(gathered, out)
    if rank == 0:
        queue.put(gathered)
    dist.destroy_process_group()


def exchange_rows(*, nproc: int, group_size: int, tier2: int, state_mb: float, reps: int) -> dict:
    from dtk.bench import spawn_ranks

    with tempfile.TemporaryDirectory(prefix="dtk-parity-") as tmp:
        ranks = spawn_ranks(_exchange_rank, nproc=nproc, args=(state_mb, group_size, tier2, reps, tmp),
                            timeout_s=1200)

    def slowest(kind: str, key: str = "seconds") -> list[float]:
        return [max(r[kind][i][key] for r in ranks) for i in range(len(ranks[0][kind]))]

    protect = slowest("protect")
    dcp_s = slowest("dcp_save")
    out = {"nproc": nproc, "parity_group": group_size, "parity_tier2": tier2, "ec_type": ranks[0]["ec_type"],
           "state_bytes": ranks[0]["state_bytes"], "parity_bytes_per_rank": ranks[0]["parity_bytes_per_rank"],
           "memory_bytes_per_rank": ranks[0]["memory_bytes"], "peak_memory_bytes_per_rank": ranks[0]["peak_memory_bytes"],
           "protect_s": protect, "protect_median_s": statistics.median(protect),
           "dcp_save_s": dcp_s, "dcp_save_median_s": statistics.median(dcp_s),
           "protect_over_dcp": statistics.median(protect) / statistics.median(dcp_s),
           "rebuild_s": slowest("rebuild"), "rebuild_median_s": statistics.median(slowest("rebuild")),
           "rebuild_tier": ranks[0]["rebuild"][0]["tier"], "rebuild_bytes": ranks[0]["rebuild"][0]["bytes_decoded"],
           "phases_median_s": {p: statistics.median(slowest("protect", p))
                               for p in ("fill_s", "tier1_s", "tier2_s", "encode_s", "vote_s", "commit_s", "cpu_s")},
           "wire_bytes_per_rank": ranks[0]["protect"][0]["bytes"]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state-mb", type=float, default=50)
    p.add_argument("--codec-mb", type=float, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--configs", default="3:3:0,4:2:1", help="nproc:parity_group:tier2, comma-separated")
    p.add_argument("--out", default=str(RESULTS / "parity.json"))
    args = p.parse_args()
    t0 = time.time()
    codec = codec_rows(args.codec_mb, args.reps)
    print(f"encode, {args.codec_mb:g} MB per shard-set, one process (best / median of {args.reps}):")
    for r in codec:
        if "error" in r:
            print(f"  tier {r['tier']} {r['code']:<28} unavailable: {r['error']}")
        else:
            extra = f"  decode {r['decode_gbps_median']:.2f}" if "decode_gbps_median" in r else ""
            print(f"  tier {r['tier']} {r['code']:<28} {r['gbps_best']:6.2f} / {r['gbps_median']:6.2f} GB/s{extra}")
    memory = memory_rows(int(args.state_mb * (1 << 20)))
    print(f"parity memory per rank / local state ({args.state_mb:g} MB):")
    for r in memory:
        print(f"  tier {r['tier']} {r['layout']:<10} {r['ratio']:.4f} (1/(k-1) or m/(G-m): {r['expected']:.4f})")
    exchanges = []
    for spec in args.configs.split(","):
        nproc, k, m = map(int, spec.split(":"))
        e = exchange_rows(nproc=nproc, group_size=k, tier2=m, state_mb=args.state_mb, reps=args.reps)
        exchanges.append(e)
        ph = e["phases_median_s"]
        print(f"{nproc} ranks, groups of {k}, tier2 m={m}: state {e['state_bytes'] / 1e6:.1f} MB/rank, "
              f"parity {e['parity_bytes_per_rank'] / 1e6:.1f} MB/rank, keeper memory "
              f"{e['memory_bytes_per_rank'] / 1e6:.1f} MB/rank held ({e['memory_bytes_per_rank'] / e['state_bytes']:.2f}x "
              f"the state), {e['peak_memory_bytes_per_rank'] / 1e6:.1f} MB during an exchange")
        print(f"  protect median {e['protect_median_s']:.3f} s (fill {ph['fill_s']:.3f}, tier1 {ph['tier1_s']:.3f}, "
              f"tier2 {ph['tier2_s']:.3f} of which encode {ph['encode_s']:.3f}, vote {ph['vote_s']:.3f}, "
              f"commit {ph['commit_s']:.3f}; thread CPU {ph['cpu_s']:.3f}); "
              f"DCP save of the same state {e['dcp_save_median_s']:.3f} s; protect/DCP {e['protect_over_dcp']:.2f}")
        print(f"  rebuild (tier {e['rebuild_tier']}, {e['rebuild_bytes'] / 1e6:.1f} MB decoded) median "
              f"{e['rebuild_median_s']:.3f} s; all: {[round(s, 3) for s in e['rebuild_s']]}")
    RESULTS.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "codec": codec, "memory": memory,
                                          "exchange": exchanges, "seconds": time.time() - t0}, indent=2) + "\n")
    print(f"wrote {args.out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
