"""Adaptive vs native collectives on the test bed (root): no congestion, one congested path, one congested host.
Each scenario runs `dtk bench comm --testbed N` `--repeats` times (native and adaptive alternate inside each run);
prints the medians and the ratios the comm layer aims at, and writes them to --out/comm_congestion.json.

    sudo python benchmarks/comm_congestion.py --hosts 4 --rate 200mbit --min-bytes 2M --max-bytes 16M --repeats 3
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from dtk.bench import run_modes
from dtk.sizes import parse_size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--rate", default="200mbit")
    ap.add_argument("--min-bytes", default="2M")
    ap.add_argument("--max-bytes", default="16M")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="runs/comm_congestion")
    a = ap.parse_args()
    p = a.hosts
    scenarios = {"clean": [], "pair": [f"pair=0-1,rate={a.rate}"], "host": [f"host=1,rate={a.rate}"]}
    med: dict[tuple, float] = {}
    plans: dict[tuple, str] = {}
    for name, congest in scenarios.items():
        runs = [run_modes(nproc=p, kinds=["all_reduce"], min_bytes=parse_size(a.min_bytes, "--min-bytes"),
                          max_bytes=parse_size(a.max_bytes, "--max-bytes"), iters=a.iters, warmup=1,
                          modes=["native", "adaptive"], out_dir=f"{a.out}/{name}-{r}", testbed=p, congest=congest,
                          show=False) for r in range(a.repeats)]
        for rows in runs:
            for row in rows:
                med.setdefault((name, row["comm"], row["size_bytes"]), []).append(row["algbw_gbps"])
                if row["comm"] == "adaptive":
                    plans[(name, row["size_bytes"])] = row["plan"]
    med = {k: statistics.median(v) for k, v in med.items()}
    sizes = sorted({k[2] for k in med})
    bound = 2 * (p - 1) / p
    out = []
    print(f"all-reduce algbw GB/s, median of {a.repeats} runs x {a.iters} iters; {p} hosts, congestion {a.rate}")
    print(f"{'size':>6} {'clean nat':>9} {'clean ad':>9} {'ad/nat':>7} | {'pair nat':>8} {'pair ad':>8} {'ad/nat':>7}"
          f" {'ad/clean':>8} | {'host nat':>8} {'host ad':>8} {'ad/nat':>7} {'/bound':>7}")
    for s in sizes:
        g = lambda n, c: med[(n, c, s)]  # noqa: E731
        row = {"size_bytes": s, **{f"{n}_{c}_algbw_gbps": g(n, c) for n in scenarios for c in ("native", "adaptive")},
               "clean_adaptive_over_native": g("clean", "adaptive") / g("clean", "native"),
               "pair_adaptive_over_native": g("pair", "adaptive") / g("pair", "native"),
               "pair_adaptive_over_clean_native": g("pair", "adaptive") / g("clean", "native"),
               "host_adaptive_over_native": g("host", "adaptive") / g("host", "native"),
               "plans": {n: plans.get((n, s)) for n in scenarios}}
        row["host_fraction_of_bound"] = row["host_adaptive_over_native"] / bound
        out.append(row)
        print(f"{s >> 20:>5}M {g('clean', 'native'):9.4f} {g('clean', 'adaptive'):9.4f} "
              f"{row['clean_adaptive_over_native']:6.2f}x | {g('pair', 'native'):8.4f} {g('pair', 'adaptive'):8.4f} "
              f"{row['pair_adaptive_over_native']:6.2f}x {row['pair_adaptive_over_clean_native']:7.2f}x | "
              f"{g('host', 'native'):8.4f} {g('host', 'adaptive'):8.4f} {row['host_adaptive_over_native']:6.2f}x "
              f"{row['host_fraction_of_bound']:6.2f}")
    geo = lambda key: math.exp(statistics.mean(math.log(r[key]) for r in out))  # noqa: E731
    summary = {k: geo(k) for k in ("clean_adaptive_over_native", "pair_adaptive_over_native",
                                   "pair_adaptive_over_clean_native", "host_adaptive_over_native",
                                   "host_fraction_of_bound")}
    print("geometric means over sizes: " + ", ".join(f"{k} {v:.2f}" for k, v in summary.items()))
    print(f"plans: " + "; ".join(f"{n}: {plans.get((n, sizes[-1]))}" for n in scenarios))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "comm_congestion.json").write_text(json.dumps(
        {"hosts": p, "rate": a.rate, "iters": a.iters, "repeats": a.repeats, "bound": bound, "rows": out,
         "geomean": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
