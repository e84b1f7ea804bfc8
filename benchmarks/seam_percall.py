"""The seam's own cost per collective, apart from the wire: CPU seconds per small all-reduce on a 1-rank group
(no peer, no latency), native gloo vs dtk's seam, alternating, in one process. CPU time, not wall time, so a
loaded machine moves it little. `--baseline REV` adds the seam as it was at a git revision, side by side.

    python benchmarks/seam_percall.py [--calls 2000] [--reps 7] [--baseline a8377a1~1]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _baseline_backend(rev: str) -> str:
    """Register dtk/comm/group.py as of `rev` under the backend name "dtk_base"."""
    source = subprocess.run(["git", "show", f"{rev}:dtk/comm/group.py"], capture_output=True, text=True, check=True,
                            cwd=ROOT).stdout.replace('BACKEND_NAME = "dtk"', 'BACKEND_NAME = "dtk_base"')
    path = Path(tempfile.mkdtemp(prefix="dtk-seam-base-")) / "seam_base.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("seam_base", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["seam_base"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    dist.Backend.register_backend("dtk_base", module._create, extended_api=True, devices=["cpu"])
    return "dtk_base"


def _cpu_us(op, calls: int) -> float:
    t0 = time.process_time()
    for _ in range(calls):
        op()
    return (time.process_time() - t0) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--bytes", type=int, default=4096)
    p.add_argument("--baseline", help="a git revision whose seam is measured too")
    p.add_argument("--out", default=str(RESULTS / "seam_percall.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    from dtk.comm.group import register

    register()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    groups = {"native": dist.group.WORLD, "seam": dist.new_group(backend="dtk")}
    if args.baseline:
        groups[f"seam@{args.baseline}"] = dist.new_group(backend=_baseline_backend(args.baseline))
    t = torch.ones(args.bytes // 4)
    ways = {"sync": lambda g: dist.all_reduce(t, group=g),
            "future": lambda g: dist.all_reduce(t, group=g, async_op=True).get_future().wait()}
    out: dict = {}
    for way, call in ways.items():
        res: dict[str, list[float]] = {name: [] for name in groups}
        for rep in range(args.reps):
            for name in (list(groups) if rep % 2 == 0 else list(groups)[::-1]):
                g = groups[name]
                _cpu_us(lambda: call(g), 50)
                res[name].append(_cpu_us(lambda: call(g), args.calls))
        out[way] = {name: {"median_us": statistics.median(v), "min_us": min(v), "max_us": max(v), "reps_us": v}
                    for name, v in res.items()}
        for name, r in out[way].items():
            print(f"{way:6s} {name:22s} {r['median_us']:7.1f} us CPU per {args.bytes} B all-reduce "
                  f"(min {r['min_us']:.1f}, max {r['max_us']:.1f})", flush=True)
    dist.destroy_process_group()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"benchmark": "seam_percall", "command": " ".join(["python", *sys.argv]),
                                          "calls": args.calls, "reps": args.reps, "bytes": args.bytes,
                                          "results": out}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
