"""GCPSL's figures: `dtk compare` of gcpsl against gcpsl_serial (time to the same target accuracy, same clients,
clusters and data), direct participation of size_balanced against random clusters, and held-out accuracy of gcpsl
against ddp on the same data split and steps.

    python benchmarks/gcpsl.py [--reps 2] [--ranks 4,2] [--steps 100] [--skip ttt,participation,accuracy]

Writes benchmarks/results/gcpsl.json (--results) and prints one table per figure. Each compare alternates which variant runs
first. ddp's accuracy: its last DCP checkpoint, loaded into the same model here and evaluated on the held-out split.
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
RECIPE = ROOT / "recipes" / "gcpsl.yaml"
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))  # this tree's dtk, also for the figures computed in this process


def env() -> dict:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    return e


def dtk(*args: str) -> None:
    cmd = [sys.executable, "-m", "dtk.cli", *map(str, args), "--no-progress"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")


def load_average() -> float:
    return os.getloadavg()[0]


def time_to_target(*, ranks: int, reps: int, steps: int, work: Path) -> dict:
    """serial / parallel seconds to the target, per repetition (the order of the two alternates)."""
    rows = []
    for rep in range(reps):
        order = ["gcpsl", "gcpsl_serial"] if rep % 2 == 0 else ["gcpsl_serial", "gcpsl"]
        out = work / f"ttt-{ranks}-{rep}"
        load = load_average()
        dtk("compare", RECIPE, f"world.nproc={ranks}", f"strategy.clusters={ranks}", f"training.steps={steps}",
            "--strategies", ",".join(order), "--out", out)
        by = {v["variant"]: v for v in json.loads((out / "compare.json").read_text())["variants"]}
        par, ser = by["gcpsl"], by["gcpsl_serial"]
        rows.append({"order": order, "load_before": load, "gcpsl_s": par["time_to_target_s"],
                     "serial_s": ser["time_to_target_s"], "gcpsl_accuracy": par["accuracy"],
                     "serial_accuracy": ser["accuracy"], "gcpsl_step_p50": par["step_time_p50"],
                     "serial_step_p50": ser["step_time_p50"],
                     "ratio": ser["time_to_target_s"] / par["time_to_target_s"]
                     if par["time_to_target_s"] and ser["time_to_target_s"] else None})
        print(f"  {ranks} ranks rep {rep}: {rows[-1]}", flush=True)
    ratios = [r["ratio"] for r in rows if r["ratio"]]
    return {"ranks": ranks, "clusters": ranks, "reps": rows, "median_ratio": statistics.median(ratios) if ratios else None}


def participation(*, seeds: int) -> dict:
    """Direct participation per assignment (the share of training samples drawn in an epoch), from dtk's own
    federation code over seeds and Dirichlet alphas; then the recipe's setting through dtk compare."""
    import torch

    from dtk.data.clients import build_federation
    from dtk.data.digits import Digits

    labels = Digits(seed=0, held_out=0.2).train_labels
    out = {}
    for alpha in (0.1, 0.5, 1.0):
        for how in ("random", "size_balanced", "label_aware"):
            values = []
            for seed in range(seeds):
                fed = build_federation(labels, clients=256, clusters=4, assignment=how, alpha=alpha, batch=32,
                                       seed=seed)
                seen = torch.zeros(len(labels), dtype=torch.bool)
                for sampler in fed.samplers:
                    for step in range(fed.global_epoch_steps):
                        seen[sampler.draw(step)] = True
                values.append(float(seen.float().mean()))
            out[f"alpha={alpha} {how}"] = statistics.fmean(values)
    return out


def accuracy_vs_ddp(*, ranks: int, steps: int, work: Path) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp

    from dtk import recipe as recipes
    from dtk.data import build_dataset
    from dtk.models import build_model

    gc_dir, ddp_dir = work / f"acc-gcpsl-{ranks}", work / f"acc-ddp-{ranks}"
    common = [f"world.nproc={ranks}", f"strategy.clusters={ranks}", f"training.steps={steps}"]
    dtk("train", RECIPE, *common, f"output.dir={gc_dir}")
    # ddp: the same model (BatchNorm, as built), data split, steps and samples per step (micro_batch per rank)
    dtk("train", RECIPE, *common, "strategy.name=ddp", f"checkpoint.every={steps}", f"output.dir={ddp_dir}")
    r = recipes.load(RECIPE, [*common, "strategy.name=ddp"])
    data = build_dataset(r.data, seed=r.training.seed)
    model = build_model(r.model, data.spec, seed=r.training.seed)
    state = {"engine": {"model": model.state_dict()}}
    dcp.load(state, checkpoint_id=str(ddp_dir / "checkpoints" / f"step_{steps}"))
    model.load_state_dict(state["engine"]["model"])
    model.eval()
    with torch.no_grad():
        ddp_acc = float((model(data.test_images).argmax(-1) == data.test_labels).float().mean())
    gc = json.loads((gc_dir / "summary.json").read_text())
    dd = json.loads((ddp_dir / "summary.json").read_text())
    return {"ranks": ranks, "steps": steps, "samples_per_step": 32 * ranks, "gcpsl_accuracy": gc["accuracy"],
            "ddp_accuracy": ddp_acc, "gcpsl_final_loss": gc["final_loss"], "ddp_final_loss": dd["final_loss"],
            "gcpsl_wall_s": gc["wall_seconds"], "ddp_wall_s": dd["wall_seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ranks", default="4,2")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--skip", default="", help="comma list of parts to leave out: ttt, participation, accuracy")
    ap.add_argument("--results", default="gcpsl.json", help="file name under benchmarks/results/")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    t0 = time.time()
    result = {"command": " ".join(["python", "benchmarks/gcpsl.py", *sys.argv[1:]]), "cores": os.cpu_count(),
              "load_at_start": load_average()}
    with tempfile.TemporaryDirectory(prefix="gcpsl-bench-") as tmp:
        work = Path(tmp)
        if "ttt" not in skip:
            result["time_to_target"] = [time_to_target(ranks=int(n), reps=args.reps, steps=args.steps, work=work)
                                        for n in args.ranks.split(",")]
        if "participation" not in skip:
            result["participation"] = participation(seeds=args.seeds)
            print("participation:", json.dumps(result["participation"], indent=1), flush=True)
        if "accuracy" not in skip:
            result["accuracy_vs_ddp"] = accuracy_vs_ddp(ranks=int(args.ranks.split(",")[0]), steps=args.steps,
                                                        work=work)
            print("accuracy:", result["accuracy_vs_ddp"], flush=True)
    result["seconds"] = time.time() - t0
    result["load_at_end"] = load_average()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / args.results).write_text(json.dumps(result, indent=2))
    for part in result.get("time_to_target", []):
        print(f"{part['ranks']} ranks / {part['clusters']} clusters: serial/gcpsl time to target, median "
              f"{part['median_ratio']}; per rep {[r['ratio'] for r in part['reps']]}")


if __name__ == "__main__":
    main()
