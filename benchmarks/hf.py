"""model.hf measured: (1) a ~50M-parameter GPT-2 built from its config under ddp, zero2 and fsdp: peak memory per
rank, and FSDP's all-gathers per step against its wrap units; (2) dtk with model.hf against a plain FSDP2 script
wrapping the same GPT2Blocks (benchmarks/plain/hf_fsdp2.py), alternating: steps/s and the ratio dtk/plain.

    python benchmarks/hf.py [--mem-steps 3] [--steps 20] [--reps 2] [--parts memory,speed]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "plain"))
import overhead  # noqa: E402  (its runners, pairing and table; the plain scripts' shared workload)
import workload  # noqa: E402

NPROC = overhead.NPROC
# ~50M parameters: 10 blocks of 12 x 640^2 (the vocabulary and context are the data's: 64 and 64)
BIG = {"n_layer": 10, "n_embd": 640, "n_head": 10}
# the speed comparison: the plain script's model (benchmarks/plain/hf_fsdp2.py), the overhead benchmark's shape
SMALL = {"n_layer": 4, "n_embd": 256, "n_head": 4}
MEM_STRATEGIES = ("ddp", "zero2", "fsdp")


def hf_overrides(fields: dict) -> list[str]:
    return ["model.hf.model_type=gpt2", *(f"model.hf.config.{k}={v}" for k, v in fields.items())]


def train(strategy: str, fields: dict, *, steps: int, warmup: int, workdir: Path, extra: list[str] = (),
          env: dict | None = None) -> Path:
    run_dir = workdir / f"dtk-{strategy}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "dtk.cli", "train", str(ROOT / "recipes" / "quickstart.yaml"),
           *overhead.dtk_overrides(), *hf_overrides(fields), f"strategy.name={strategy}", f"training.steps={steps}",
           f"training.untimed_steps={warmup}", f"output.dir={run_dir}", "--no-progress", *extra]
    overhead._check(subprocess.run(cmd, capture_output=True, text=True, env={**overhead.env(), **(env or {})},
                                   cwd=ROOT), f"dtk train ({strategy})")
    return run_dir


def memory(*, steps: int, workdir: Path, mmap_threshold: int) -> dict:
    """Peak memory per rank (CPU: RSS growth from before the model was built) and FSDP's collectives per step.
    With glibc's default, a freed block above the (self-raising) mmap threshold stays in the heap, so RSS keeps
    what FSDP's all-gather buffers and the freed unsharded model once held; a fixed threshold
    (MALLOC_MMAP_THRESHOLD_) hands large blocks back, and RSS follows the live tensors."""
    env = {"MALLOC_MMAP_THRESHOLD_": str(mmap_threshold)} if mmap_threshold else {}
    out = {}
    for strategy in MEM_STRATEGIES:
        print(f"memory: {strategy}", flush=True)
        run_dir = train(strategy, BIG, steps=steps, warmup=1, workdir=workdir, env=env,
                        # a loaded machine can take over a minute for one step of this model: not a hang
                        extra=["training.micro_batch=2", "resilience.heartbeat_timeout_s=900"])
        summary = json.loads((run_dir / "summary.json").read_text())
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        per_rank = [max(r["peak_memory_bytes"][q] for r in records) for q in range(NPROC)]
        by_kind = summary["comm"]["by_kind"]
        out[strategy] = {"peak_memory_bytes_per_rank": per_rank, "final_loss": summary["final_loss"],
                         "step_time_p50": summary["step_time_p50"],
                         "calls_per_step": {k: v["calls_per_step"] for k, v in by_kind.items()},
                         "fsdp_wrap_units": summary["fsdp_wrap_units"]}
    fsdp = out["fsdp"]
    units = fsdp["fsdp_wrap_units"]["count"]
    # every unit is gathered for forward and again for backward; dtk reshards the root after forward too
    fsdp["all_gathers_expected"] = 2 * units + 2
    fsdp["all_gathers_measured"] = fsdp["calls_per_step"].get("all_gather")
    return out


def run_dtk(*, steps: int, warmup: int, workdir: Path) -> dict:
    run_dir = train("fsdp", SMALL, steps=steps, warmup=warmup, workdir=workdir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [r["step_seconds"] for r in records if r["step"] >= warmup]
    return {"steps_per_s": len(timed) / sum(timed), "final_loss": records[-1]["loss"]}


def run_plain(*, steps: int, warmup: int, workdir: Path) -> dict:
    out = workdir / f"plain-hf-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}",
           str(ROOT / "benchmarks" / "plain" / "hf_fsdp2.py"), f"--steps={steps}", f"--warmup={warmup}",
           "--backend=gloo", f"--out={out}"]
    overhead._check(subprocess.run(cmd, capture_output=True, text=True, env=overhead.env(), cwd=ROOT), "plain hf fsdp2")
    result = json.loads(out.read_text())
    return {"steps_per_s": result["steps_per_s"], "final_loss": result["final_loss"]}


def print_memory(mem: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"GPT-2 ~50M parameters from config, {NPROC} ranks, gloo: peak memory per rank")
    for col in ("strategy", "peak rank 0", "peak rank 1", "step p50 s", "all-gathers/step", "wrap units"):
        table.add_column(col, justify="left" if col in ("strategy", "wrap units") else "right")
    for name, m in mem.items():
        units = m["fsdp_wrap_units"]
        table.add_row(name, *(f"{b / 2**20:,.0f} MiB" for b in m["peak_memory_bytes_per_rank"]),
                      f"{m['step_time_p50']:.2f}", f"{m['calls_per_step'].get('all_gather', 0):g}",
                      f"{units['classes']} + root" if units else "-")
    Console(width=None if sys.stdout.isatty() else 140).print(table)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="memory,speed")
    p.add_argument("--mem-steps", type=int, default=3)
    p.add_argument("--mmap-threshold", type=int, default=1 << 20,
                   help="MALLOC_MMAP_THRESHOLD_ for the memory runs (bytes); 0 = glibc's default (dynamic).")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--out", default=str(overhead.RESULTS / "hf.json"))
    args = p.parse_args()
    parts = args.parts.split(",")
    t0 = time.time()
    report = {"benchmark": "hf", "command": " ".join(["python", *sys.argv]), "nproc": NPROC}
    with tempfile.TemporaryDirectory(prefix="dtk-hf-") as tmp:
        if "memory" in parts:
            mem = memory(steps=args.mem_steps, workdir=Path(tmp), mmap_threshold=args.mmap_threshold)
            print_memory(mem)
            f = mem["fsdp"]
            print(f"fsdp all-gathers per step: measured {f['all_gathers_measured']:g}, 2 x {f['fsdp_wrap_units']['count']} "
                  f"units + 2 (root) = {f['all_gathers_expected']}")
            report["memory"] = {"model": BIG, "micro_batch": 2, "steps": args.mem_steps,
                                "malloc_mmap_threshold": args.mmap_threshold or "glibc default", "results": mem}
        if "speed" in parts:
            kw = {"steps": args.steps, "warmup": args.warmup, "workdir": Path(tmp)}
            res = overhead.alternate({"dtk": lambda: run_dtk(**kw), "plain": lambda: run_plain(**kw)}, reps=args.reps)
            c = overhead.compare(res["dtk"], res["plain"])
            overhead.print_table(f"dtk model.hf vs plain FSDP2 on GPT-2 {SMALL}, {NPROC} ranks (median of {args.reps})",
                                 [("fsdp", c)], "dtk", "plain")
            report["speed"] = {"model": SMALL, "vocab": workload.VOCAB, "seq_len": workload.SEQ_LEN,
                               "micro_batch": workload.MICRO_BATCH, "steps": args.steps, "warmup": args.warmup,
                               "reps": args.reps, "dtk_steps_per_s": c["a_steps_per_s"],
                               "plain_steps_per_s": c["b_steps_per_s"], "ratio_dtk_over_plain": c["ratio"],
                               "paired_ratios": c["paired_ratios"], "final_loss_dtk": c["a_final_loss"],
                               "final_loss_plain": c["b_final_loss"]}
    report["wall_seconds"] = time.time() - t0
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out} ({report['wall_seconds']:.0f}s)")


if __name__ == "__main__":
    main()
