"""What building a model costs each rank: `dtk train` for one step per strategy on a large GPT, and summary.json's
build_peak_memory_bytes (RSS growth on CPU, allocated bytes on CUDA, from the start of the build to the first step)
against the whole model's fp32 bytes. One run at a time (the model is large).

    python benchmarks/build_memory.py [--layers 24] [--width 1024] [--strategies ddp,fsdp,zero3] [--device cpu]
        [recipe overrides, e.g. strategy.bucket_mb=25]

Where a zero3 rank's build goes, phase by phase: benchmarks/zero3_build_phases.py.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def run(strategy: str, *, layers: int, width: int, nproc: int, device: str, extra: list[str]) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"build-{strategy}-"))
    cmd = [sys.executable, "-m", "dtk.cli", "train", str(ROOT / "recipes" / "quickstart.yaml"),
           f"strategy.name={strategy}", f"model.layers={layers}", f"model.width={width}", "model.heads=16",
           "data.seq_len=32", "training.micro_batch=1", "training.steps=1", "training.untimed_steps=0",
           f"world.nproc={nproc}", f"world.device={device}", f"output.dir={out}",
           # the first step of a large model on a loaded CPU outlasts the default 60 s before a hang is declared
           "resilience.heartbeat_timeout_s=900",
           "output.save_final=false",  # 1.2 GB of final/model.safetensors per run, after what is measured
           "--no-progress", *extra]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if p.returncode != 0:
        return {"strategy": strategy, "error": p.stderr[-2000:]}
    s = json.loads((out / "summary.json").read_text())
    full = s["parameters"] * 4
    return {"strategy": strategy, "parameters": s["parameters"], "model_fp32_bytes": full,
            "build_peak_memory_bytes": s["build_peak_memory_bytes"],
            "ratio_to_model": [b / full for b in s["build_peak_memory_bytes"]], "wall_s": time.time() - t0}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--strategies", default="ddp,fsdp,zero3")
    p.add_argument("--out", default=str(RESULTS / "build_memory.json"))
    p.add_argument("overrides", nargs="*", help="recipe overrides for every run")
    a = p.parse_args()
    rows = [run(s, layers=a.layers, width=a.width, nproc=a.nproc, device=a.device, extra=a.overrides)
            for s in a.strategies.split(",")]
    print("| strategy | parameters | model fp32 | build peak per rank | ÷ model |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['strategy']} | failed: {r['error'].splitlines()[-1] if r['error'] else '?'} | | | |")
            continue
        peaks = ", ".join(f"{b / 2**20:,.0f} MiB" for b in r["build_peak_memory_bytes"])
        ratios = ", ".join(f"{x:.2f}" for x in r["ratio_to_model"])
        print(f"| {r['strategy']} | {r['parameters']:,} | {r['model_fp32_bytes'] / 2**20:,.0f} MiB | {peaks} | {ratios} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
