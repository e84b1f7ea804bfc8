"""A whole host lost (its launcher, ranks and shadows SIGKILLed at once), on dtk's test bed of 2 emulated hosts x 2
ranks: in-place recovery on the surviving host against the checkpoint-restart baseline across hosts, on the same
failure, side by side. Downtime runs from the host's loss to the completion, after recovery, of the step it
interrupted; the in-place side includes the time node 0 takes to notice the silent host.

    python benchmarks/host_loss.py [--reps 2] [--strategies ddp,zero2] [--at 25] [--every 10] [--phase forward]

The 3.2M-parameter GPT of the other recovery benchmarks; checkpoint every `--every` steps, host 1 lost at step
`--at`, in phase `--phase` (forward: at the step's start, while the last boundary's protection is still being sent,
the worst case for a sharded strategy; optimizer: before the rank's update, after the step's gradients were
reduced). Sharded strategies keep parity per host with one Reed-Solomon shard across the hosts (tier 2), so the lost
host's shards come back from the other host. Needs root (network namespaces). Repetitions alternate the order.
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
from overhead import NPROC, dtk_overrides  # noqa: E402  (the workload of every benchmark here)
from inplace import stage_medians  # noqa: E402
from recovery import RunFailed, _run  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def run_host_loss(strategy: str, mode: str, *, at: int, every: int, phase: str, workdir: Path) -> dict:
    run_dir = workdir / f"{strategy}-{mode}-{time.monotonic_ns()}"
    layout = [f"resilience.parity_group={NPROC}", "resilience.parity_tier2=1"] if strategy != "ddp" else []
    cmd = [sys.executable, "-m", "dtk.cli", "train", str(ROOT / "recipes" / "quickstart.yaml"), *dtk_overrides(),
           f"strategy.name={strategy}", f"training.steps={at + 1}", f"resilience.mode={mode}",
           f"resilience.shadows={NPROC}", *layout, f"checkpoint.every={every}", f"output.dir={run_dir}",
           "--testbed", "2", "--fault", f"kill-host:host=1,step={at},phase={phase}", "--no-progress"]
    _run(cmd, what=f"dtk {strategy} host loss {mode}")
    summary = json.loads((run_dir / "summary.json").read_text())
    failures = summary["failures"]
    if sorted(f["rank"] for f in failures) != [NPROC, NPROC + 1] or any(f.get("downtime_s") is None for f in failures):
        raise RunFailed(f"{strategy} {mode}: expected ranks {NPROC} and {NPROC + 1} lost with host 1: {failures}")
    f = max(failures, key=lambda f: f["downtime_s"])
    return {"downtime_s": f["downtime_s"], "steps_lost": f["steps_lost"], "breakdown_s": f.get("breakdown_s", {}),
            "node_silent_s": f.get("node_silent_s"), "node_refused": f.get("node_refused"),
            "rebuilt_from": f.get("rebuilt_from"),
            "replacements": [(r["rank"], r["node"], r["replacement"]) for r in f.get("replacements", [])],
            "final_loss": summary["final_loss"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--strategies", default="ddp,zero2")
    p.add_argument("--at", type=int, default=25, help="the step at which host 1 is lost")
    p.add_argument("--every", type=int, default=10, help="checkpoint.every (both sides write checkpoints)")
    p.add_argument("--phase", default="forward", choices=["forward", "backward", "optimizer"],
                   help="where in step --at the host is lost")
    p.add_argument("--out", default=str(RESULTS / "host_loss.json"))
    args = p.parse_args()
    t0 = time.time()
    cases: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="dtk-host-loss-") as tmp:
        for strategy in args.strategies.split(","):
            runs: dict[str, list] = {"checkpoint": [], "inplace": []}
            for rep in range(args.reps):
                for mode in (("checkpoint", "inplace") if rep % 2 == 0 else ("inplace", "checkpoint")):
                    runs[mode].append(run_host_loss(strategy, mode, at=args.at, every=args.every, phase=args.phase,
                                                      workdir=Path(tmp)))
                    print(f"  {strategy} {mode} rep {rep + 1}: downtime {runs[mode][-1]['downtime_s']:.2f}s "
                          f"({time.time() - t0:.0f}s in)", flush=True)
            med = {k: statistics.median(r["downtime_s"] for r in v) for k, v in runs.items()}
            cases[strategy] = {"runs": runs, "downtime_median_s": med,
                               "ratio_checkpoint_over_inplace": med["checkpoint"] / med["inplace"]}
    print(f"\n{'strategy':<9} {'checkpoint s':>13} {'in place s':>11} {'ratio':>7}  in-place stages (median s)")
    for name, c in cases.items():
        line = stage_medians(c["runs"]["inplace"])
        print(f"{name:<9} {c['downtime_median_s']['checkpoint']:>13.2f} {c['downtime_median_s']['inplace']:>11.2f} "
              f"{c['ratio_checkpoint_over_inplace']:>6.1f}x  {line}")
    report = {"benchmark": "host_loss", "command": " ".join(["python", *sys.argv]), "cases": cases,
              "wall_seconds": time.time() - t0}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out} ({report['wall_seconds']:.0f}s)")


if __name__ == "__main__":
    main()
