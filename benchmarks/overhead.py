"""dtk's cost against plain code: the same GPT and batches trained by `dtk train` and by hand-written torchrun
scripts (benchmarks/plain/), alternating dtk/plain per strategy; steps/s and the ratio dtk/plain.

    python benchmarks/overhead.py [--reps 2] [--steps 20] [--strategies ddp,fsdp,zero1,zero2,zero3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAIN = ROOT / "benchmarks" / "plain"
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(PLAIN))
import workload  # noqa: E402  (the plain scripts' model, data and optimizer settings: dtk gets the same)

SCRIPTS = {"ddp": "ddp.py", "fsdp": "fsdp2.py", "zero1": "zero2.py", "zero2": "zero2.py", "zero3": "zero2.py"}
STAGE = {"zero1": 1, "zero3": 3}  # the plain DeepSpeed script runs every stage
NPROC = 2


def env() -> dict:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    return e


def dtk_overrides() -> list[str]:
    m = workload.MODEL
    return [f"model.layers={m['layers']}", f"model.width={m['width']}", f"model.heads={m['heads']}",
            f"data.vocab_size={workload.VOCAB}", f"data.seq_len={workload.SEQ_LEN}",
            f"training.micro_batch={workload.MICRO_BATCH}", f"training.seed={workload.SEED}",
            f"optimizer.lr={workload.LR}", f"optimizer.betas=[{workload.BETAS[0]}, {workload.BETAS[1]}]",
            "optimizer.weight_decay=0", "optimizer.grad_clip=0", "training.precision=fp32", f"world.nproc={NPROC}"]


def _check(p: subprocess.CompletedProcess, what: str) -> None:
    if p.returncode != 0:
        sys.exit(f"{what} exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")


def run_dtk(strategy: str, *, steps: int, warmup: int, workdir: Path) -> dict:
    """`dtk train` on the workload; steps/s over the steps after warm-up, from its per-step records."""
    run_dir = workdir / f"dtk-{strategy}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "dtk.cli", "train", str(ROOT / "recipes" / "quickstart.yaml"), *dtk_overrides(),
           f"strategy.name={strategy}", f"training.steps={steps}", f"training.untimed_steps={warmup}",
           f"output.dir={run_dir}", "--no-progress"]
    _check(subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT), f"dtk train ({strategy})")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [r["step_seconds"] for r in records if r["step"] >= warmup]
    return {"steps_per_s": len(timed) / sum(timed), "final_loss": records[-1]["loss"]}


def run_plain(strategy: str, *, steps: int, warmup: int, workdir: Path, backend: str = "gloo") -> dict:
    """The hand-written script for `strategy` under torchrun, on plain gloo or on dtk's seam."""
    out = workdir / f"plain-{strategy}-{backend}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}",
           str(PLAIN / SCRIPTS[strategy]), f"--steps={steps}", f"--warmup={warmup}", f"--backend={backend}",
           f"--out={out}"]
    if strategy in STAGE:
        cmd.append(f"--stage={STAGE[strategy]}")
    _check(subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT), f"plain {strategy} ({backend})")
    result = json.loads(out.read_text())
    return {"steps_per_s": result["steps_per_s"], "final_loss": result["final_loss"]}


def alternate(runners: dict, *, reps: int) -> dict[str, list[dict]]:
    """Run each of `runners` (name -> no-argument callable) `reps` times, swapping the order every repetition so
    slow spells of the shared machine do not always land on the same side."""
    results: dict[str, list[dict]] = {name: [] for name in runners}
    names = list(runners)
    for rep in range(reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            results[name].append(runners[name]())
            print(f"  rep {rep + 1}/{reps} {name}: {results[name][-1]['steps_per_s']:.3f} steps/s", flush=True)
    return results


def compare(a: list[dict], b: list[dict]) -> dict:
    """a vs b: median steps/s of each, the ratio of medians, and the paired per-repetition ratios."""
    sa, sb = [r["steps_per_s"] for r in a], [r["steps_per_s"] for r in b]
    return {"a_steps_per_s": sa, "b_steps_per_s": sb, "a_median": statistics.median(sa),
            "b_median": statistics.median(sb), "ratio": statistics.median(sa) / statistics.median(sb),
            "paired_ratios": [x / y for x, y in zip(sa, sb)],
            "a_final_loss": a[-1]["final_loss"], "b_final_loss": b[-1]["final_loss"]}


def print_table(title: str, rows: list[tuple[str, dict]], a: str, b: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("what", f"{a} steps/s", f"{b} steps/s", f"{a}/{b}", "paired ratios", f"final loss {a} / {b}"):
        table.add_column(col, justify="left" if col in ("what", "paired ratios") else "right")
    for name, c in rows:
        table.add_row(name, f"{c['a_median']:.3f}", f"{c['b_median']:.3f}", f"{c['ratio']:.3f}x",
                      " ".join(f"{r:.2f}" for r in c["paired_ratios"]),
                      f"{c['a_final_loss']:.5f} / {c['b_final_loss']:.5f}")
    Console(width=None if sys.stdout.isatty() else 140).print(table)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", default="ddp,fsdp,zero1,zero2,zero3")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--out", default=str(RESULTS / "overhead.json"))
    args = p.parse_args()
    t0 = time.time()
    rows = []
    with tempfile.TemporaryDirectory(prefix="dtk-overhead-") as tmp:
        for strategy in args.strategies.split(","):
            print(f"{strategy}:", flush=True)
            kw = {"steps": args.steps, "warmup": args.warmup, "workdir": Path(tmp)}
            res = alternate({"dtk": lambda: run_dtk(strategy, **kw), "plain": lambda: run_plain(strategy, **kw)},
                            reps=args.reps)
            rows.append((strategy, compare(res["dtk"], res["plain"])))
    print_table(f"dtk train vs plain torchrun scripts, {NPROC} ranks, gloo (median of {args.reps})", rows, "dtk", "plain")
    report = {"benchmark": "overhead", "command": " ".join(["python", *sys.argv]), "nproc": NPROC,
              "workload": {"model": workload.MODEL, "vocab": workload.VOCAB, "seq_len": workload.SEQ_LEN,
                           "micro_batch": workload.MICRO_BATCH},
              "steps": args.steps, "warmup": args.warmup, "reps": args.reps, "wall_seconds": time.time() - t0,
              "results": {name: {"dtk_steps_per_s": c["a_steps_per_s"], "plain_steps_per_s": c["b_steps_per_s"],
                                 "dtk_median": c["a_median"], "plain_median": c["b_median"],
                                 "ratio_dtk_over_plain": c["ratio"], "paired_ratios": c["paired_ratios"],
                                 "final_loss_dtk": c["a_final_loss"], "final_loss_plain": c["b_final_loss"]}
                          for name, c in rows}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out} ({report['wall_seconds']:.0f}s)")


if __name__ == "__main__":
    main()
