"""What a person sees of a run: the launcher's one progress line, and summary.json made from metrics.jsonl."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dtk.metrics import read_jsonl, write_atomic

console = Console(stderr=True)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _rate(record: dict) -> str:
    if record.get("tokens_per_second"):
        return f"{record['tokens_per_second']:,.0f} tok/s"
    return f"{record['samples_per_second']:,.0f} samples/s"


class ProgressLine:
    """One line for the whole run (not one per rank), fed by rank 0's metrics.jsonl."""

    def __init__(self, run_dir: Path, *, total: int, enabled: bool):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.total = total
        self._offset = 0
        self._last: dict | None = None
        self._eval: dict | None = None
        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                                 disable=not enabled)
        self.task = self.progress.add_task("starting ranks…", total=total)

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        self.progress.__exit__(*exc)

    def update(self) -> None:
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self._offset)
            chunk = f.read()
        end = chunk.rfind("\n")
        if end < 0:
            return
        self._offset += len(chunk[:end + 1].encode())
        for line in chunk[:end + 1].splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "loss" in record:  # event lines (failures) carry no loss
                self._last = record
            elif "eval_loss" in record:
                self._eval = record
        r = self._last
        if r:
            lr = f" | lr {r['lr']:.2e}" if "lr" in r else ""
            desc = (f"loss {r['loss']:.4f}{lr} | {_rate(r)} | {r['step_seconds'] * 1000:.0f} ms/step | "
                    f"peak {human_bytes(max(r['peak_memory_bytes']))}")
            if self._eval:
                desc += f" | eval {self._eval['eval_loss']:.4f}"
            self.progress.update(self.task, completed=r["step"] + 1, description=desc)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(run_dir: Path, *, wall_seconds: float, failures: list[dict], exit_code: int, **extra) -> dict:
    recipe_text = (Path(run_dir) / "recipe.yaml").read_text() if (Path(run_dir) / "recipe.yaml").exists() else ""
    import yaml

    recipe = yaml.safe_load(recipe_text) or {}
    untimed = recipe.get("training", {}).get("untimed_steps", 0)
    world = recipe.get("world", {}).get("nproc", 1)
    lines = read_jsonl(Path(run_dir) / "metrics.jsonl")
    records = [r for r in lines if "loss" in r]
    timed = [r for r in records if r["step"] >= untimed] or records
    times = [r["step_seconds"] for r in timed]
    after_first = [r for r in records if r["step"] > (records[0]["step"] if records else 0)] or records
    kinds = sorted({k for r in after_first for k in r["comm"]["by_kind"]})
    n = max(len(after_first), 1)
    by_kind = {}
    for k in kinds:
        tot = {f: sum(r["comm"]["by_kind"].get(k, {}).get(f, 0) for r in after_first)
               for f in ("calls", "bytes", "size_bytes", "seconds")}
        by_kind[k] = {
            "calls_per_step": tot["calls"] / n,
            "bytes_per_step": tot["bytes"] / n,
            "size_bytes_per_step": tot["size_bytes"] / n,
            "seconds_per_step": tot["seconds"] / n,
            "algbw_gbps": tot["size_bytes"] / tot["seconds"] / 1e9 if tot["seconds"] else 0.0,
            "busbw_gbps": tot["bytes"] / tot["seconds"] / 1e9 if tot["seconds"] else 0.0,
        }
    useful = sum(r["step_seconds"] for r in records)
    states = next((r["model_state_bytes"] for r in reversed(records) if r.get("model_state_bytes")), None)
    rate_key = "tokens_per_second" if records and records[0].get("tokens_per_second") else "samples_per_second"
    return {
        "status": {0: "completed", 130: "interrupted", 143: "interrupted"}.get(exit_code, "failed"),
        "exit_code": exit_code,
        "steps": len(records),
        "world_size": world,
        "final_loss": records[-1]["loss"] if records else None,
        "losses": [r["loss"] for r in records],
        "wall_seconds": wall_seconds,
        "untimed_steps": min(untimed, len(records)),
        "throughput": statistics.fmean(r[rate_key] for r in timed) if timed else 0.0,
        "throughput_unit": rate_key.replace("_per_second", "/s"),
        "step_time_p50": percentile(times, 0.5),
        "step_time_p95": percentile(times, 0.95),
        "peak_memory_bytes": max((max(r["peak_memory_bytes"]) for r in records), default=0),
        # rank 0's, from its tensors; it holds the largest shard (FSDP2 rounds shards up on the first ranks,
        # DeepSpeed pads partitions to equal sizes)
        "parameters": (_last_event(run_dir, "model", since=time.time() - wall_seconds - 1.0) or {}).get("parameters"),
        # per rank, from the start of the model's build to the first step (of this attempt)
        "build_peak_memory_bytes": next((r["build_peak_memory_bytes"] for r in reversed(records)
                                         if "build_peak_memory_bytes" in r), None),
        # what the first step computed in (weights, activations) and what its optimizer updated (master)
        "dtypes": next((r["dtypes"] for r in reversed(records) if r.get("dtypes")), None),
        "model_state_bytes": states["total"] if states else None,
        "model_state": states,
        "comm": {
            "bytes_per_step": sum(v["bytes_per_step"] for v in by_kind.values()),
            "seconds_per_step": sum(v["seconds_per_step"] for v in by_kind.values()),
            "by_kind": by_kind,
        },
        "failures": failures,
        "productive_time_ratio": useful / wall_seconds if wall_seconds else 0.0,
        "fsdp_wrap_units": _last_event(run_dir, "fsdp_wrap_units", since=time.time() - wall_seconds - 1.0),
        "parity": _last_event(run_dir, "parity", since=time.time() - wall_seconds - 1.0),
        **learning_figures(records, target=recipe.get("training", {}).get("target_accuracy")),
        **eval_figures(lines),
        "epochs": _epochs(run_dir, steps=len(records), since=time.time() - wall_seconds - 1.0),
        **extra,
    }


def learning_figures(records: list[dict], *, target: float | None) -> dict:
    """What an engine that measures learning (gcpsl) reported: the last held-out accuracy, the mean direct
    participation over complete global epochs (else the running one), the first time to the target accuracy."""
    accuracy = [r["accuracy"] for r in records if r.get("accuracy") is not None]
    epochs = [r["epoch_participation"] for r in records if r.get("epoch_participation") is not None]
    running = [r["participation"] for r in records if r.get("participation") is not None]
    reached = [r["time_to_target_s"] for r in records if r.get("time_to_target_s") is not None]
    return {
        "accuracy": accuracy[-1] if accuracy else None,
        "best_accuracy": max(accuracy) if accuracy else None,
        "participation": statistics.fmean(epochs) if epochs else running[-1] if running else None,
        "target_accuracy": target,
        "time_to_target_s": reached[0] if reached else None,
    }


def eval_figures(lines: list[dict]) -> dict:
    """The evaluations (eval.every): the last one's figures, the best loss, and the curve."""
    evals = [r for r in lines if "eval_loss" in r]
    last = evals[-1] if evals else {}
    return {
        "eval_loss": last.get("eval_loss"),
        "eval_perplexity": last.get("eval_perplexity"),
        "eval_accuracy": last.get("eval_accuracy"),
        "best_eval_loss": min((r["eval_loss"] for r in evals), default=None),
        "evals": [{k: v for k, v in r.items() if k in ("step", "eval_loss", "eval_perplexity", "eval_accuracy")}
                  for r in evals],
    }


def _epochs(run_dir: Path, *, steps: int, since: float) -> float | None:
    """Passes over the training windows the run's steps made (data that counts them: tokens)."""
    data = _last_event(run_dir, "data", since=since)
    return steps * data["samples_per_step"] / data["windows"] if data and data.get("windows") else None


def _last_event(run_dir: Path, name: str, *, since: float) -> dict | None:
    """The last event `name` rank 0 reported in this run (its fields; a reused run folder keeps older runs'
    events), or None: FSDP's wrap units, the parity keeper's figures."""
    found = [e for e in read_jsonl(Path(run_dir) / "events.jsonl")
             if e.get("event") == name and e.get("time", 0) >= since]
    if not found:
        return None
    return {k: v for k, v in found[-1].items() if k not in ("event", "time")}



def write_summary(run_dir: Path, *, wall_seconds: float, failures: list[dict], exit_code: int,
                  name: str = "summary.json", **extra) -> dict:
    summary = summarize(run_dir, wall_seconds=wall_seconds, failures=failures, exit_code=exit_code, **extra)
    write_atomic(Path(run_dir) / name, json.dumps(summary, indent=2))
    return summary
