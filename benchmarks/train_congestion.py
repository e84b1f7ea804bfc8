"""Training steps/s under congestion on the test bed (root): for each strategy, `dtk compare --testbed H` trains
the recipe with comm.mode native and adaptive one after the other, the path 0-1 shaped from step S on; prints
steps/s before and after the congestion for both and the ratios; writes --out/train_congestion.json.

    sudo python benchmarks/train_congestion.py --strategies ddp,fsdp,zero2 --hosts 4 --rate 200mbit --step 5 --steps 15
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def steps_per_second(run_dir: Path, lo: int, hi: int) -> float:
    """1 / median step time over steps lo..hi-1 (the median keeps one slow step of a loaded machine out)."""
    times = [r["step_seconds"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r and lo <= r["step"] < hi]
    return 1.0 / statistics.median(times) if times else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "quickstart.yaml"))
    ap.add_argument("--strategies", default="ddp,fsdp,zero2")
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--rate", default="200mbit")
    ap.add_argument("--step", type=int, default=5, help="the congestion starts at this step")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the 'before' figure")
    ap.add_argument("--override", action="append", default=[], help="extra recipe overrides, key=value")
    ap.add_argument("--out", default="runs/train_congestion")
    a = ap.parse_args()
    out = Path(a.out)
    fault = f"congest:pair=0-1,rate={a.rate},step={a.step}"
    rows = []
    for strategy in a.strategies.split(","):
        folder = out / strategy
        cmd = [sys.executable, "-m", "dtk.cli", "compare", a.recipe, "world.nproc=1", f"strategy.name={strategy}",
               f"training.steps={a.steps}", *a.override, "--testbed", str(a.hosts),
               "--variant", "native:comm.mode=native", "--variant", "adaptive:comm.mode=adaptive",
               "--fault", fault, "--out", str(folder), "--no-progress"]
        t0 = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            print(f"{strategy}: dtk compare exited {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
            continue
        result = json.loads((folder / "compare.json").read_text())
        by = {v["variant"]: v for v in result["variants"]}
        row = {"strategy": strategy, "seconds": time.time() - t0, "params": by["native"]["params"],
               "comm_bytes_per_step": by["native"]["comm_bytes_per_step"],
               "max_rel_loss_diff": by["adaptive"]["max_rel_loss_diff"]}
        for name in ("native", "adaptive"):
            run_dir = Path(by[name]["run_dir"])
            row[f"{name}_before"] = steps_per_second(run_dir, a.warmup, a.step)
            # step S itself holds rank 0's wait for the shaping: left out
            row[f"{name}_after"] = steps_per_second(run_dir, a.step + 1, a.steps)
        plans = [e for e in read_jsonl(folder / "adaptive" / "events.jsonl") if e["event"] == "comm_plan"]
        row["plan_after"] = plans[-1]["after"] if plans else "native (no change)"
        row["plan_changes_at_steps"] = [e["step"] for e in plans]
        row["adaptive_over_native_after"] = row["adaptive_after"] / row["native_after"]
        row["native_after_over_before"] = row["native_after"] / row["native_before"]
        row["adaptive_after_over_native_before"] = row["adaptive_after"] / row["native_before"]
        rows.append(row)
        print(f"{strategy:6} native {row['native_before']:.2f} -> {row['native_after']:.2f} steps/s | adaptive "
              f"{row['adaptive_before']:.2f} -> {row['adaptive_after']:.2f} steps/s | adaptive/native under congestion "
              f"{row['adaptive_over_native_after']:.2f}x, of uncongested native {row['adaptive_after_over_native_before']:.2f}x"
              f" | loss diff {row['max_rel_loss_diff']:.1e} | plan changes at {row['plan_changes_at_steps']}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"hosts": a.hosts, "ranks_per_host": 1, "fault": fault, "steps": a.steps, "warmup": a.warmup,
            "recipe": a.recipe, "overrides": a.override,
            "figures": "steps/s = 1 / median step time; before: steps warmup..S-1, after: steps S+1..end"}
    (out / "train_congestion.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
