"""In-place recovery with shadow ranks against dtk's checkpoint-restart baseline, on the same failure, side by side:
downtime (fault to the completion, after recovery, of the step it interrupted) and its stages, per model size and
fault kind; and what keeping a shadow costs a run without failures (steps/s with resilience.shadows=1 / 0).

    python benchmarks/inplace.py [--reps 2] [--models small,big] [--faults kill,hang] [--steady-steps 60]
        [--strategies ddp,fsdp,zero1,zero2,zero3] [--parity-steps 40] [--protect-every 1,auto] [--phase forward]

small = the recovery benchmark's 3.2M-parameter GPT (checkpoint every 10, fault at step 25); big = a ~50M-parameter
GPT (8 layers x 704; checkpoint every 5, fault at step 12). 2 ranks, gloo, each strategy given (sharded ones rebuild
the lost rank from parity). Repetitions alternate the order. --parity-steps: what keeping parity current costs a
sharded run without failures (steps/s with resilience.mode=inplace and no shadow / resilience.mode=none), for each
--protect-every (resilience.protect_every; the failure runs use the first).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from overhead import dtk_overrides  # noqa: E402  (the workload of every benchmark here)
from recovery import RunFailed, _run  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODELS = {
    "small": {"overrides": [], "every": 10, "at": 25},
    "big": {"overrides": ["model.layers=8", "model.width=704", "model.heads=8"], "every": 5, "at": 12},
}


def run_failure(model: str, fault: str, mode: str, workdir: Path, strategy: str = "ddp", every: str = "1",
                phase: str = "forward", extra: list[str] | None = None) -> dict:
    m = MODELS[model]
    run_dir = workdir / f"{model}-{fault}-{mode}-{strategy}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "dtk.cli", "inject-failure", str(ROOT / "recipes" / "quickstart.yaml"),
           *dtk_overrides(), *m["overrides"], f"strategy.name={strategy}", f"training.steps={m['at'] + 1}",
           f"resilience.mode={mode}", f"checkpoint.every={m['every']}", f"resilience.protect_every={every}",
           *(extra or []), f"output.dir={run_dir}",
           "--fault", f"{fault}:rank=1,step={m['at']}" + (f",phase={phase}" if phase != "forward" else ""),
           "--no-progress"]
    _run(cmd, what=f"dtk {model} {fault} {mode}")
    summary = json.loads((run_dir / "summary.json").read_text())
    (f,) = summary["failures"]
    if f.get("downtime_s") is None:
        raise RunFailed(f"{model} {fault} {mode}: no downtime in summary.json: {f}")
    return {"downtime_s": f["downtime_s"], "detect_s": f["detect_s"], "steps_lost": f["steps_lost"],
            "breakdown_s": f.get("breakdown_s", {}), "repair_bytes": f.get("repair_bytes"),
            "replacement": [r["replacement"] for r in f.get("replacements", [])],
            "rebuilt_from": f.get("rebuilt_from"), "rolled_forward": f.get("rolled_forward"),
            "hang_timeout_s": summary.get("resilience", {}).get("heartbeat_timeout_s"),
            "final_loss": summary["final_loss"]}


def run_steady(shadows: int, steps: int, workdir: Path) -> float:
    run_dir = workdir / f"steady-{shadows}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "dtk.cli", "train", str(ROOT / "recipes" / "quickstart.yaml"), *dtk_overrides(),
           f"training.steps={steps}", "training.untimed_steps=5", "resilience.mode=inplace",
           f"resilience.shadows={shadows}", f"output.dir={run_dir}", "--no-progress"]
    _run(cmd, what=f"dtk steady shadows={shadows}")
    return json.loads((run_dir / "summary.json").read_text())["throughput"]


def run_parity(strategy: str, mode: str, steps: int, workdir: Path, every: str = "1",
               extra: list[str] | None = None) -> dict:
    run_dir = workdir / f"parity-{strategy}-{mode}-{every}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "dtk.cli", "train", str(ROOT / "recipes" / "quickstart.yaml"), *dtk_overrides(),
           f"strategy.name={strategy}", f"training.steps={steps}", "training.untimed_steps=5",
           f"resilience.mode={mode}", f"resilience.protect_every={every}", "resilience.shadows=0",
           *(extra or []), f"output.dir={run_dir}", "--no-progress"]
    _run(cmd, what=f"dtk parity {strategy} {mode} every {every}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"tokens_per_s": summary["throughput"], "parity": summary.get("parity")}


def stage_medians(runs: list[dict]) -> str:
    """`detect 0.012 release 0.001 ...`: each downtime stage's median over the runs."""
    stages: dict[str, list[float]] = {}
    for r in runs:
        for k, v in r["breakdown_s"].items():
            stages.setdefault(k, []).append(v)
    return " ".join(f"{k} {statistics.median(v):.3f}" for k, v in stages.items())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--models", default="small,big")
    p.add_argument("--faults", default="kill,hang", help='"" leaves the failure runs out')
    p.add_argument("--steady-steps", type=int, default=60, help="0: leave out the steady-state cost")
    p.add_argument("--strategies", default="ddp")
    p.add_argument("--parity-steps", type=int, default=0, help="steps of the parity cost runs (0: leave them out)")
    p.add_argument("--protect-every", default="1", help="resilience.protect_every values for the parity cost runs")
    p.add_argument("--parity-override", action="append", default=[],
                   help="a recipe override for the parity cost runs, e.g. resilience.mtbf_s=600 (repeatable)")
    p.add_argument("--inplace-override", action="append", default=[],
                   help="a recipe override for the in-place failure runs, e.g. resilience.roll_forward=true")
    p.add_argument("--phase", default="forward",
                   help="where in the step the fault fires: forward (the step's start, while the last boundary's "
                        "background protection may be in flight: the worst case), backward, optimizer or commit")
    p.add_argument("--out", default=str(RESULTS / "inplace.json"))
    args = p.parse_args()
    t0 = time.time()
    cases: dict[str, dict] = {}
    steady: dict[int, list[float]] = {1: [], 0: []}
    with tempfile.TemporaryDirectory(prefix="dtk-inplace-") as tmp:
        workdir = Path(tmp)
        for strategy in args.strategies.split(","):
            for model in args.models.split(","):
                for fault in filter(None, args.faults.split(",")):  # --faults "": the parity cost runs alone
                    runs: dict[str, list] = {"checkpoint": [], "inplace": []}
                    for rep in range(args.reps):
                        for mode in (("checkpoint", "inplace") if rep % 2 == 0 else ("inplace", "checkpoint")):
                            runs[mode].append(run_failure(model, fault, mode, workdir, strategy,
                                                          args.protect_every.split(",")[0], args.phase,
                                                          args.inplace_override if mode == "inplace" else None))
                            print(f"  {strategy} {model} {fault} {mode} rep {rep + 1}: downtime "
                                  f"{runs[mode][-1]['downtime_s']:.2f}s ({time.time() - t0:.0f}s in)", flush=True)
                    med = {k: statistics.median(r["downtime_s"] for r in v) for k, v in runs.items()}
                    cases[f"{strategy} {model} {fault}"] = {
                        "runs": runs, "downtime_median_s": med,
                        "ratio_checkpoint_over_inplace": med["checkpoint"] / med["inplace"]}
        parity_cost: dict[str, dict] = {}
        everies = args.protect_every.split(",")
        for strategy in (s for s in args.strategies.split(",") if s != "ddp" and args.parity_steps):
            modes = ["none", *(f"inplace:{e}" for e in everies)]
            runs = {m: [] for m in modes}
            for rep in range(args.reps):
                for mode in (modes if rep % 2 == 0 else modes[::-1]):
                    name, _, every = mode.partition(":")
                    runs[mode].append(run_parity(strategy, name, args.parity_steps, workdir, every or "1",
                                                 args.parity_override))
            tps = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
            parity_cost[strategy] = {"runs": runs, "ratio": {e: tps[f"inplace:{e}"] / tps["none"] for e in everies},
                                     "parity": {e: runs[f"inplace:{e}"][-1]["parity"] for e in everies}}
            print(f"  parity {strategy}: steps/s with parity / without {parity_cost[strategy]['ratio']}", flush=True)
        for rep in range(args.reps if args.steady_steps else 0):
            for shadows in ((1, 0) if rep % 2 == 0 else (0, 1)):
                steady[shadows].append(run_steady(shadows, args.steady_steps, workdir))
                print(f"  steady shadows={shadows} rep {rep + 1}: {steady[shadows][-1]:,.0f} tokens/s", flush=True)
    print(f"\n{'case':<22} {'checkpoint s':>13} {'in place s':>11} {'ratio':>7}  in-place stages (median s)")
    for name, c in cases.items():
        line = stage_medians(c["runs"]["inplace"])
        print(f"{name:<22} {c['downtime_median_s']['checkpoint']:>13.2f} {c['downtime_median_s']['inplace']:>11.2f} "
              f"{c['ratio_checkpoint_over_inplace']:>6.1f}x  {line}")
    report = {"benchmark": "inplace", "command": " ".join(["python", *sys.argv]), "cases": cases,
              "parity_cost": parity_cost, "wall_seconds": time.time() - t0}
    for strategy, c in parity_cost.items():
        for every, ratio in c["ratio"].items():
            par = c["parity"][every] or {}
            ex = par.get("exchange", {})
            print(f"parity {strategy} every {every}: steps/s ratio {ratio:.3f}; interval {par.get('protect_interval')} "
                  f"({par.get('why')}); memory {par.get('protection_memory_bytes')} B held for "
                  f"{par.get('local_state_bytes')} B of local state; totals {ex.get('totals')}")
    if steady[1] and steady[0]:
        report["steady"] = {"tokens_per_s_shadows_1": steady[1], "tokens_per_s_shadows_0": steady[0],
                            "ratio": statistics.median(steady[1]) / statistics.median(steady[0])}
        print(f"steady state, tokens/s with a shadow / without: {report['steady']['ratio']:.3f} "
              f"({steady[1]} vs {steady[0]})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out} ({report['wall_seconds']:.0f}s)")


if __name__ == "__main__":
    main()
