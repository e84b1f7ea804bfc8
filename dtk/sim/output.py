"""What the simulators show and write: rich tables, the JSON with its inputs, and a PNG plot (matplotlib, Agg)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from rich.table import Table


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unreachable"
    if seconds == float("inf"):
        return "any (no failure)"
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.2f} s"


def productivity_table(rows: list[dict]) -> Table:
    methods = list(rows[0]["methods"])
    table = Table(title="productive time, simulated (first order)")
    for col in ("GPUs", "nodes", "MTTF", "failures", *methods):
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        cells = [f"{_pct(m['productive_time_ratio'])} ({_pct(m['first_order'])})" for m in r["methods"].values()]
        first = next(iter(r["methods"].values()))
        table.add_row(f"{r['gpus']:,}", f"{r['nodes']:,}", _duration(r["mttf_h"] * 3600), f"{first['failures']:,}",
                      *cells)
    return table


def crossover_line(gpus: int | None, *, up_to: int) -> str:
    """Where in place starts to keep more of the time than checkpoint restart (first order)."""
    if gpus is None:
        return (f"inplace overtakes checkpoint restart at no job size up to {up_to:,} GPUs: its protection costs "
                f"more than checkpointing loses")
    if gpus == 0:
        return "inplace keeps more of the time than checkpoint restart at every job size, from one node (first order)"
    return f"inplace overtakes checkpoint restart from {gpus:,} GPUs (first order; below, checkpointing keeps more)"


def needed_table(rows: list[dict], target: float) -> Table:
    methods = list(rows[0]["methods"])
    table = Table(title=f"recovery time needed for {_pct(target)} (knob)")
    for col in ("GPUs", *methods):
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(f"{r['gpus']:,}", *(f"{_duration(m['recovery_needed_s'])} ({m['recovery_knob']})"
                                          for m in r["methods"].values()))
    return table


def _finite(x):
    """Strict JSON has no infinity: a recovery time needed with no failure in the period is written as null."""
    if isinstance(x, float) and not np.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_json(path: str | Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(payload), indent=2, allow_nan=False) + "\n")
    return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def productivity_png(path: str | Path, rows: list[dict], *, target: float | None, title: str) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    gpus = [r["gpus"] for r in rows]
    for name in rows[0]["methods"]:
        ax.plot(gpus, [100 * r["methods"][name]["productive_time_ratio"] for r in rows], marker="o", label=name)
    if target is not None:
        ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1, label=f"target {_pct(target)}")
    ax.set_xscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("productive time (%)")
    ax.set_ylim(0, 101)
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def congestion_table(rows: list[dict]) -> Table:
    gains = np.array([r["gain"] for r in rows])
    table = Table(title=f"algbw gain, adaptive / native ({len(rows)} random draws)")
    for col in ("min", "p10", "p50", "p90", "max", "mean", "draws with gain > 1.05"):
        table.add_column(col, justify="right")
    table.add_row(*(f"{x:.2f}x" for x in (*np.percentile(gains, [0, 10, 50, 90, 100]), gains.mean())),
                  _pct(float(np.mean(gains > 1.05))))
    return table


def plan_counts(rows: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["plan"]] = counts.get(r["plan"], 0) + 1
    return counts


def testbed_table(rows: list[dict]) -> Table:
    table = Table(title="test bed predictions: all-reduce, per congestion case, size and plan (* = chosen)")
    for col in ("congest", "size", "plan", "time s", "algbw GB/s", "÷ native"):
        table.add_column(col, no_wrap=True, justify="left" if col in ("congest", "plan") else "right")
    for r in rows:
        table.add_row(r["congest"], f"{r['size_bytes'] >> 20}M", ("* " if r["chosen"] else "  ") + r["plan"],
                      f"{r['time_s']:.3f}", f"{r['algbw_gbps']:.3f}", f"{r['gain_vs_native']:.2f}x")
    return table


def congestion_png(path: str | Path, rows: list[dict], *, title: str) -> Path:
    plt = _pyplot()
    gains = np.sort([r["gain"] for r in rows])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(gains, np.arange(1, len(gains) + 1) / len(gains), drawstyle="steps-post")
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter

    for axis in (ax.xaxis.set_major_formatter, ax.xaxis.set_minor_formatter):
        axis(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.set_xlim(gains[0], max(gains[-1], gains[0] * 1.1))
    ax.set_xlabel("algbw gain, adaptive / native")
    ax.set_ylabel("fraction of draws with at most this gain")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
