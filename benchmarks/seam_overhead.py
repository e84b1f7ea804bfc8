"""What dtk's seam (the wrapper process group) costs: all-reduce algbw per size through the seam vs native gloo, and
steps/s of the plain scripts (every strategy) on `--backend dtk` vs `--backend gloo`, in one run.

    python benchmarks/seam_overhead.py [--reps 2] [--steps 20] [--max-bytes 16M] [--strategies ddp,fsdp,...]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from overhead import NPROC, RESULTS, alternate, compare, print_table, run_plain

from dtk.bench import run_sweep
from dtk.sizes import human_size, parse_size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--min-bytes", default="4K")
    p.add_argument("--max-bytes", default="16M")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--strategies", default="ddp,fsdp,zero1,zero2,zero3")
    p.add_argument("--out", default=str(RESULTS / "seam_overhead.json"))
    args = p.parse_args()
    t0 = time.time()

    print("all-reduce, native gloo vs seam:", flush=True)
    sweep = run_sweep(nproc=NPROC, kinds=["all_reduce"], min_bytes=parse_size(args.min_bytes, "--min-bytes"),
                      max_bytes=parse_size(args.max_bytes, "--max-bytes"), iters=args.iters, warmup=2)
    ratios = [r["seam_over_native_algbw"] for r in sweep]

    rows = []
    with tempfile.TemporaryDirectory(prefix="dtk-seam-") as tmp:
        for strategy in args.strategies.split(","):
            print(f"{strategy}:", flush=True)
            kw = {"steps": args.steps, "warmup": args.warmup, "workdir": Path(tmp)}
            res = alternate({"seam": lambda: run_plain(strategy, backend="dtk", **kw),
                             "gloo": lambda: run_plain(strategy, backend="gloo", **kw)}, reps=args.reps)
            rows.append((strategy, compare(res["seam"], res["gloo"])))
    print_table(f"plain scripts on dtk's seam vs on gloo, {NPROC} ranks (median of {args.reps})", rows, "seam", "gloo")
    print(f"all-reduce seam/native algbw: median {statistics.median(ratios):.3f}x over {len(ratios)} sizes "
          f"({human_size(sweep[0]['size_bytes'])}..{human_size(sweep[-1]['size_bytes'])}), "
          f"min {min(ratios):.2f}x, max {max(ratios):.2f}x")

    report = {"benchmark": "seam_overhead", "command": " ".join(["python", *sys.argv]), "nproc": NPROC,
              "wall_seconds": time.time() - t0,
              "all_reduce": {"iters": args.iters, "median_ratio_seam_over_native_algbw": statistics.median(ratios),
                             "rows": sweep},
              "training": {"steps": args.steps, "warmup": args.warmup, "reps": args.reps,
                           "results": {name: {"seam_steps_per_s": c["a_steps_per_s"], "gloo_steps_per_s": c["b_steps_per_s"],
                                              "seam_median": c["a_median"], "gloo_median": c["b_median"],
                                              "ratio_seam_over_gloo": c["ratio"], "paired_ratios": c["paired_ratios"],
                                              "final_loss_seam": c["a_final_loss"], "final_loss_gloo": c["b_final_loss"]}
                                       for name, c in rows}}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out} ({report['wall_seconds']:.0f}s)")


if __name__ == "__main__":
    main()
