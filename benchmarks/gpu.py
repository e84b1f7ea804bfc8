"""The CUDA/NCCL path, measured in one go (benchmarks/gpu.sh runs it): dtk's steps/s per strategy against the same
strategy without the seam (world.backend=nccl plain vs the seam is not separable in dtk train, so "plain" is the
torchrun script of benchmarks/plain/ where one exists for CUDA, else left out), the seam's per-call cost against
native NCCL, in-place recovery downtime (kill) for ddp and zero2 against checkpoint restart, the steady cost of
in-place protection, and a meta-init model larger than one rank's share. Writes one JSON and one markdown table.
Every stage has its own time limit and records its failure instead of stopping the others.

    python benchmarks/gpu.py [--out benchmarks/results/gpu.json] [--dry-run] [--nproc N]
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
GPT = ["model.layers=4", "model.width=256", "model.heads=4", "data.seq_len=64", "training.micro_batch=8",
       "optimizer.lr=0.003"]
STRATEGIES = ["ddp", "fsdp", "zero1", "zero2", "zero3"]


class Stages:
    def __init__(self, *, dry_run: bool, nproc: int):
        self.dry_run, self.nproc, self.results, self.rows = dry_run, nproc, {}, []

    def sh(self, cmd: list[str], *, limit: float) -> subprocess.CompletedProcess | None:
        print("$", " ".join(cmd), flush=True)
        if self.dry_run:
            return None
        return subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))

    def train(self, *overrides: str, limit: float = 90, command: str = "train", faults: list[str] = ()) -> dict | None:
        out = Path(tempfile.mkdtemp(prefix="dtk-gpu-"))
        cmd = [sys.executable, "-m", "dtk.cli", command, str(ROOT / "recipes" / "quickstart.yaml"), *GPT,
               f"world.nproc={self.nproc}", "world.device=cuda", "world.backend=nccl", f"output.dir={out}",
               *overrides, "--no-progress", *[a for f in faults for a in ("--fault", f)]]
        p = self.sh(cmd, limit=limit)
        if p is None:
            return None
        if p.returncode != 0:
            raise RuntimeError(f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1:] or ''}")
        return json.loads((out / "summary.json").read_text())

    def stage(self, name: str, fn) -> None:
        t0 = time.time()
        try:
            self.results[name] = fn()
        except Exception as e:  # a stage that fails says why; the others still run
            self.results[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"[{name}] {time.time() - t0:.0f}s", flush=True)


def throughput(st: Stages) -> dict:
    out = {}
    for s in STRATEGIES:
        summary = st.train(f"strategy.name={s}", "training.steps=40", "training.untimed_steps=5")
        plain = st.sh(["torchrun", "--standalone", f"--nproc-per-node={st.nproc}", "benchmarks/plain/cuda_train.py",
                       "--strategy", s, "--steps", "40"], limit=90) if s in ("ddp", "fsdp") else None
        entry = {"dtk_tokens_per_s": summary and summary["throughput"]}
        if plain is not None and plain.returncode == 0:
            entry["plain_tokens_per_s"] = json.loads(plain.stdout.strip().splitlines()[-1])["tokens_per_s"]
            entry["dtk_over_plain"] = entry["dtk_tokens_per_s"] / entry["plain_tokens_per_s"]
        out[s] = entry
    return out


def seam_cost(st: Stages) -> dict | None:
    p = st.sh(["torchrun", "--standalone", f"--nproc-per-node={st.nproc}", "benchmarks/plain/cuda_seam.py"], limit=90)
    return None if p is None else json.loads(p.stdout.strip().splitlines()[-1])


def recovery(st: Stages) -> dict:
    out = {}
    for s in ("ddp", "zero2"):
        for mode, extra in (("inplace", ["resilience.mode=inplace"]),
                            ("checkpoint", ["resilience.mode=checkpoint", "checkpoint.every=10"])):
            summary = st.train(f"strategy.name={s}", "training.steps=30", *extra, command="inject-failure",
                               faults=["kill:rank=1,step=15"], limit=150)
            out[f"{s}/{mode}"] = summary and [f.get("downtime_s") for f in summary["failures"]]
        if out.get(f"{s}/inplace") and out.get(f"{s}/checkpoint"):
            out[f"{s}/checkpoint_over_inplace"] = out[f"{s}/checkpoint"][0] / out[f"{s}/inplace"][0]
    return out


def protection(st: Stages) -> dict:
    out = {}
    for mode in ("none", "inplace"):
        summary = st.train("strategy.name=zero2", "training.steps=40", f"resilience.mode={mode}")
        out[mode] = summary and summary["throughput"]
    if out.get("none") and out.get("inplace"):
        out["inplace_over_none"] = out["inplace"] / out["none"]
    return out


def meta_init(st: Stages) -> dict | None:
    p = st.sh([sys.executable, "benchmarks/build_memory.py", "--device", "cuda", "--nproc", str(st.nproc),
               "--layers", "24", "--width", "2048", "--strategies", "fsdp,zero3",
               "--out", str(Path(tempfile.mkdtemp()) / "build.json")], limit=240)
    return None if p is None else {"table": p.stdout}


def table(results: dict) -> str:
    lines = ["| figure | value |", "|---|---|"]
    for s, e in (results.get("throughput") or {}).items():
        if isinstance(e, dict) and "dtk_tokens_per_s" in e:
            ratio = f" (÷ plain {e['dtk_over_plain']:.3f})" if "dtk_over_plain" in e else ""
            lines.append(f"| {s} tokens/s | {e['dtk_tokens_per_s'] or 0:,.0f}{ratio} |")
    seam = results.get("seam_cost") or {}
    if "added_us" in seam:
        lines.append(f"| seam cost per 4 KiB all-reduce vs NCCL | {seam['added_us']:+.1f} µs "
                     f"(native {seam['median_s']['native'] * 1e6:.1f} µs) |")
    for k, v in (results.get("recovery") or {}).items():
        lines.append(f"| recovery {k} | {v} |")
    for k, v in (results.get("protection") or {}).items():
        lines.append(f"| protection zero2 {k} | {v} |")
    if (results.get("meta_init") or {}).get("table"):
        lines.append("")
        lines.append(results["meta_init"]["table"])
    errors = {k: v["error"] for k, v in results.items() if isinstance(v, dict) and "error" in v}
    lines += [f"\n{k} failed: {e}" for k, e in errors.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu.json"))
    p.add_argument("--nproc", type=int, default=0, help="ranks (default: every visible GPU, at least 2)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing (no GPU needed)")
    a = p.parse_args()
    nproc = a.nproc
    if not nproc:
        import torch

        nproc = max(2, torch.cuda.device_count())
    st = Stages(dry_run=a.dry_run, nproc=nproc)
    for name, fn in (("throughput", throughput), ("seam_cost", seam_cost), ("recovery", recovery),
                     ("protection", protection), ("meta_init", meta_init)):
        st.stage(name, lambda fn=fn: fn(st))
    if a.dry_run:
        return
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"nproc": nproc, "time": time.time(), **st.results}, indent=2))
    md = table(st.results)
    Path(a.out).with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
