"""What one SIGKILLed rank costs: dtk's checkpoint-restart baseline (per strategy) against plain torchrun
`--max-restarts 1` with DCP (benchmarks/plain/restart_ddp.py), and dtk's in-place recovery; the downtime, split
into stages, median over repetitions that alternate dtk and torchrun.

    python benchmarks/recovery.py [--reps 2] [--strategies ddp,fsdp,zero2] [--no-inplace]

Downtime runs from the kill to the completion, after recovery, of the step the kill interrupted (dtk's definition,
applied to both). Each side marks the same moments: process start, imports done, group made, engine built,
checkpoint loaded, each step's end.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAIN = ROOT / "benchmarks" / "plain"
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
from overhead import NPROC, dtk_overrides, env  # noqa: E402  (the workload both sides train, as overhead.py)

EVERY, KILL_STEP = 10, 25
STEPS = KILL_STEP + 1  # the run ends with the step the kill interrupted: nothing after it is measured
RUN_TIMEOUT_S = 400
RESTART_STAGES = ("to_new_process", "import", "group_init", "engine_build", "checkpoint_load", "replay",
                  "interrupted_step")
"""Stages both restarts share. to_new_process = detect + stop + start of the new processes (dtk splits it; for
torchrun it is split from its log lines); interrupted_step = redoing the step the kill interrupted."""
INPLACE_STAGES = ("detect", "release", "plan", "regroup", "state_transfer", "redo")


class RunFailed(RuntimeError):
    pass


def _run(cmd: list[str], *, what: str) -> subprocess.CompletedProcess:
    """Run in its own session, so a run past the timeout is ended with every process it started."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT,
                         start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise RunFailed(f"{what}: still running after {RUN_TIMEOUT_S}s; killed") from None
    if p.returncode != 0:
        raise RunFailed(f"{what} exited {p.returncode}:\n{stdout[-1500:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr)


# -- dtk --
def run_dtk(strategy: str, *, mode: str, workdir: Path) -> dict:
    run_dir = workdir / f"dtk-{strategy}-{mode}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "dtk.cli", "inject-failure", str(ROOT / "recipes" / "quickstart.yaml"),
           *dtk_overrides(), f"strategy.name={strategy}", f"training.steps={STEPS}", f"resilience.mode={mode}",
           f"checkpoint.every={EVERY}", f"output.dir={run_dir}", "--fault", f"kill:rank=1,step={KILL_STEP}",
           "--no-progress"]
    _run(cmd, what=f"dtk {strategy} {mode}")
    summary = json.loads((run_dir / "summary.json").read_text())
    (f,) = summary["failures"]
    if f.get("downtime_s") is None or "breakdown_s" not in f:
        raise RunFailed(f"dtk {strategy} {mode}: summary.json has no downtime figures: {f}")
    b = dict(f["breakdown_s"])
    if mode == "checkpoint":
        b["interrupted_step"] = f["downtime_s"] - sum(b.values())  # the breakdown ends where the redo begins
        b["to_new_process"] = b["detect"] + b["stop"] + b["process_start"]
    return {"downtime_s": f["downtime_s"], "detect_s": f["detect_s"], "steps_lost": f["steps_lost"],
            "breakdown_s": b, "wall_s": summary["wall_seconds"], "final_loss": summary["final_loss"]}


# -- plain torchrun --
_LOG_LINE = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d:\d\d:\d\d\.\d+) +\d+ .*?\] (.*)$")


def _log_time(line: str, year: int) -> tuple[float, str] | None:
    """torchrun's glog-style `W1202 12:17:56.459000 PID file:line] message` -> (epoch seconds, message)."""
    m = _LOG_LINE.match(line)
    if not m:
        return None
    month, day, clock, message = m.groups()
    stamp = datetime.datetime.strptime(f"{year}-{month}-{day} {clock}", "%Y-%m-%d %H:%M:%S.%f")
    return stamp.timestamp(), message


def run_torchrun(*, workdir: Path) -> dict:
    out = workdir / f"torchrun-{time.monotonic_ns()}"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}",
           "--max-restarts=1", str(PLAIN / "restart_ddp.py"), f"--steps={STEPS}", f"--every={EVERY}",
           f"--kill-step={KILL_STEP}", f"--out-dir={out}"]
    p = _run(cmd, what="torchrun restart_ddp.py")
    t_kill = json.loads((out / "kill.json").read_text())["time"]
    rows = [json.loads(line) for r in range(NPROC) for line in (out / f"rank{r}.jsonl").read_text().splitlines()]
    timelines = [r for r in rows if r["event"] == "timeline" and r["attempt"] == 1]
    steps = [r for r in (json.loads(line) for line in (out / "rank0.jsonl").read_text().splitlines())
             if r["event"] == "step" and r["attempt"] == 1]  # rank 0's records, as dtk's metrics.jsonl
    if len(timelines) != NPROC or not any(s["step"] == KILL_STEP for s in steps):
        raise RunFailed(f"torchrun: attempt 1 did not get back to step {KILL_STEP}:\n{p.stderr[-3000:]}")
    last = lambda key: max(t[key] for t in timelines)  # noqa: E731 - the slowest rank sets each stage's end
    ready = last("loaded_at")
    back = next(s["time"] for s in steps if s["step"] == KILL_STEP)
    replayed = [s["time"] for s in steps if s["step"] < KILL_STEP]
    replay_end = max(replayed) if replayed else ready
    b = {"to_new_process": last("main_at") - t_kill, "import": last("imported_at") - last("main_at"),
         "group_init": last("group_at") - last("imported_at"), "engine_build": last("engine_at") - last("group_at"),
         "checkpoint_load": ready - last("engine_at"), "replay": replay_end - ready,
         "interrupted_step": back - replay_end}
    # torchrun's own log splits to_new_process: it logs just before SIGTERMing the survivor (the kill is seen) and
    # once the survivor is gone (stopped); what follows is its re-rendezvous and the new processes' start.
    year = datetime.datetime.fromtimestamp(t_kill).year
    stamps = [s for s in (_log_time(line, year) for line in p.stderr.splitlines()) if s and s[0] >= t_kill - 1]
    seen = next((t for t, m in stamps if "closing signal" in m), None)
    stopped = next((t for t, m in stamps if m.startswith("failed (exitcode")), None)
    if seen is not None and stopped is not None:
        b.update(detect=max(0.0, seen - t_kill), stop=stopped - max(seen, t_kill),
                 process_start=last("main_at") - stopped)
    return {"downtime_s": back - t_kill, "steps_lost": KILL_STEP - timelines[0]["start_step"], "breakdown_s": b,
            "final_loss": steps[-1]["loss"]}


# -- the comparison --
def median_of(runs: list[dict], key: str) -> float | None:
    values = [r["breakdown_s"][key] for r in runs if key in r["breakdown_s"]]
    return statistics.median(values) if values else None


def summarize(runs: list[dict], stages: tuple[str, ...], *, extra: tuple[str, ...] = ()) -> dict:
    downtimes = [r["downtime_s"] for r in runs]
    return {"runs": len(runs), "downtime_s": downtimes, "downtime_median_s": statistics.median(downtimes),
            "steps_lost": [r["steps_lost"] for r in runs],
            "breakdown_median_s": {k: median_of(runs, k) for k in (*stages, *extra) if median_of(runs, k) is not None}}


def print_tables(variants: dict[str, dict], reps: int) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    base = variants.get("torchrun ddp (checkpoint restart)", {}).get("downtime_median_s")
    table = Table(title=f"downtime of one SIGKILLed rank at step {KILL_STEP} ({NPROC} ranks, gloo, checkpoint every "
                        f"{EVERY}; median of {reps}; seconds)")
    for col in ("what", "downtime", "runs", "steps lost", "/ torchrun", *RESTART_STAGES):
        table.add_column(col.replace("_", " "), justify="left" if col == "what" else "right")
    for name, v in variants.items():
        if "error" in v:
            table.add_row(name, "failed", *["-"] * (3 + len(RESTART_STAGES)))
            continue
        m = v["breakdown_median_s"]
        table.add_row(name, fmt(v["downtime_median_s"]), " ".join(f"{d:.1f}" for d in v["downtime_s"]),
                      str(statistics.median(v["steps_lost"])), fmt(v["downtime_median_s"] / base) if base else "-",
                      *(fmt(m.get(k)) if k in m else "·" for k in RESTART_STAGES))
    console.print(table)
    split = Table(title="to_new_process split (median s); in place: its own stages")
    for col in ("what", "detect", "stop", "process start", "release", "plan", "regroup", "state transfer", "redo"):
        split.add_column(col, justify="left" if col == "what" else "right")
    for name, v in variants.items():
        if "error" not in v:
            m = v["breakdown_median_s"]
            split.add_row(name, *(fmt(m.get(k)) for k in ("detect", "stop", "process_start", "release", "plan",
                                                          "regroup", "state_transfer", "redo")))
    console.print(split)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", default="ddp,fsdp,zero2")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--no-inplace", dest="inplace", action="store_false", help="Leave out dtk's in-place run.")
    p.add_argument("--out", default=str(RESULTS / "recovery.json"))
    args = p.parse_args()
    t0 = time.time()
    runners: dict[str, tuple] = {}
    with tempfile.TemporaryDirectory(prefix="dtk-recovery-") as tmp:
        workdir = Path(tmp)
        runners["torchrun ddp (checkpoint restart)"] = (lambda: run_torchrun(workdir=workdir), RESTART_STAGES)
        for s in args.strategies.split(","):
            runners[f"dtk {s} (checkpoint restart)"] = (
                lambda s=s: run_dtk(s, mode="checkpoint", workdir=workdir), RESTART_STAGES)
            if s == "ddp" and args.inplace:
                runners["dtk ddp (in place)"] = (lambda: run_dtk("ddp", mode="inplace", workdir=workdir),
                                                 INPLACE_STAGES)
        results: dict[str, list] = {name: [] for name in runners}
        errors: dict[str, list[str]] = {name: [] for name in runners}
        names = list(runners)
        for rep in range(args.reps):
            # torchrun and dtk's ddp baseline sit next to each other, and the order flips every repetition, so
            # a slow spell of the shared machine does not always land on the same side
            for name in (names if rep % 2 == 0 else names[::-1]):
                try:
                    results[name].append(runners[name][0]())
                    print(f"  rep {rep + 1}/{args.reps} {name}: downtime {results[name][-1]['downtime_s']:.2f}s "
                          f"({time.time() - t0:.0f}s in)", flush=True)
                except RunFailed as e:
                    errors[name].append(str(e))
                    print(f"  rep {rep + 1}/{args.reps} {name}: FAILED\n{e}", flush=True)
    variants = {}
    for name, (_, stages) in runners.items():
        extra = ("detect", "stop", "process_start") if stages is RESTART_STAGES else ()
        variants[name] = summarize(results[name], stages, extra=extra) if results[name] else {"error": errors[name]}
        variants[name].update(raw=results[name], errors=errors[name])
    print_tables(variants, args.reps)
    med = lambda name: variants.get(name, {}).get("downtime_median_s")  # noqa: E731
    ratios = {}
    if med("torchrun ddp (checkpoint restart)"):
        for s in args.strategies.split(","):
            if med(f"dtk {s} (checkpoint restart)"):
                ratios[f"dtk_{s}_baseline_over_torchrun_ddp"] = med(f"dtk {s} (checkpoint restart)") / med(
                    "torchrun ddp (checkpoint restart)")
    if med("dtk ddp (in place)") and med("dtk ddp (checkpoint restart)"):
        ratios["dtk_ddp_inplace_over_baseline"] = med("dtk ddp (in place)") / med("dtk ddp (checkpoint restart)")
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    # every run, recovered by whichever means, must end on the same loss: recovery must not change training
    final_losses = sorted({r["final_loss"] for v in variants.values() for r in v["raw"]})
    print(f"final loss at step {KILL_STEP} of every run: {' '.join(f'{x:.6f}' for x in final_losses)}")
    report = {"benchmark": "recovery", "command": " ".join(["python", *sys.argv]), "nproc": NPROC,
              "workload": "benchmarks/plain/workload.py (GPT 4 layers x 256, seq 64, micro-batch 8, AdamW)",
              "steps": STEPS, "kill": f"kill:rank=1,step={KILL_STEP}", "checkpoint_every": EVERY, "reps": args.reps,
              "wall_seconds": time.time() - t0, "ratios": ratios, "final_losses": final_losses,
              "variants": variants}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out} ({report['wall_seconds']:.0f}s)")


if __name__ == "__main__":
    main()
