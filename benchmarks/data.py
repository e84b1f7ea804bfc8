"""Token data measured (issue 22's three figures), side by side in one run, ratios reported:

1. prepare: `dtk data prepare` throughput (text MB/s) / the plain `tokenizers` batch-encode script
   (benchmarks/plain/tokenize_plain.py) on the same files and tokenizer, alternating, in this process (imports excluded);
2. data cost: `dtk train` steps/s on data.name=tokens / on data.name=synthetic, same GPT, same tokens per step,
   alternating; and each data set's own batch() time per step;
3. memory: peak resident memory per rank training on a 1 GB token file vs a 10 MB one (random tokens, made on /tmp
   for the run and deleted after).

    python benchmarks/data.py --corpus FOLDER [--reps 3] [--steps 40] [--parts prepare,speed,memory]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "plain"))
import tokenize_plain as plain  # noqa: E402

from dtk.data.prepare import prepare  # noqa: E402

MODEL = ["model.layers=2", "model.width=64", "model.heads=4", "training.micro_batch=16", "world.nproc=2",
         "training.untimed_steps=4"]


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}


def train(*overrides: str, workdir: Path, steps: int) -> dict:
    run_dir = workdir / f"run-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "dtk.cli", "train", str(ROOT / "recipes" / "corpus.yaml"), *MODEL, "eval.every=0",
           f"training.steps={steps}", f"output.dir={run_dir}", "--no-progress", *overrides]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT)
    if p.returncode:
        raise SystemExit(f"dtk train failed ({p.returncode}): {p.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    summary["peak_per_rank"] = [max(r["peak_memory_bytes"][q] for r in records) for q in range(2)]
    shutil.rmtree(run_dir)
    return summary


def part_prepare(corpus: Path, *, reps: int, workdir: Path) -> dict:
    files = sorted(f for f in corpus.rglob("*") if f.suffix in (".txt", ".md"))
    tok_dir = workdir / "tok"
    prepare(sources=[str(corpus)], out=str(tok_dir), tokenizer=None, train_tokenizer=2048, seq_len=128, progress=False)
    rows = []
    for rep in range(reps):
        order = ("dtk", "plain") if rep % 2 == 0 else ("plain", "dtk")
        row = {}
        for who in order:
            out = workdir / f"{who}-{rep}"
            if who == "dtk":
                meta = prepare(sources=[str(corpus)], out=str(out), tokenizer=str(tok_dir / "tokenizer"),
                               train_tokenizer=None, seq_len=128, progress=False)
                row["dtk_mb_s"] = meta["text_bytes"] / 1e6 / meta["prepare_seconds"]
                row["dtk_tokens"] = meta["train_tokens"] + meta["val_tokens"]
                shutil.rmtree(out)
            else:
                r = plain.tokenize(files, tokenizer_json=tok_dir / "tokenizer" / "tokenizer.json", out=out)
                row["plain_mb_s"] = r["text_bytes"] / 1e6 / r["seconds"]
                row["plain_tokens"] = r["tokens"]
                out.unlink()
        row["ratio"] = row["dtk_mb_s"] / row["plain_mb_s"]
        print(f"prepare rep {rep}: {row}", flush=True)
        rows.append(row)
    return {"files": len(files), "text_mb": sum(f.stat().st_size for f in files) / 1e6, "reps": rows,
            "ratio_median": statistics.median(r["ratio"] for r in rows), "tokenizer_dir": str(tok_dir)}


def batch_ms(name: str, path: str | None, *, steps: int = 20) -> float:
    """One rank's data cost per step: batch() of micro_batch 16, in this process."""
    from dtk.data import build_dataset
    from dtk.recipe import build

    data = {"name": name, "seq_len": 128, **({"path": path} if path else {"vocab_size": 2048})}
    d = build_dataset(build({"data": data}).data, seed=0, world=2)
    t0 = time.perf_counter()
    for s in range(steps):
        d.batch(step=s, rank=0, micro=0, size=16)
    return (time.perf_counter() - t0) / steps * 1000


def part_speed(prepared: Path, *, reps: int, steps: int, workdir: Path) -> dict:
    tokens = [f"data.path={prepared}", "data.seq_len=128"]
    synthetic = ["data.name=synthetic", "data.vocab_size=2048", "data.seq_len=128"]
    rows = []
    for rep in range(reps):
        order = ("tokens", "synthetic") if rep % 2 == 0 else ("synthetic", "tokens")
        row = {}
        for who in order:
            s = train(*(tokens if who == "tokens" else synthetic), workdir=workdir, steps=steps)
            row[who] = 1 / s["step_time_p50"]
        row["ratio"] = row["tokens"] / row["synthetic"]
        print(f"speed rep {rep}: {row}", flush=True)
        rows.append(row)
    return {"reps": rows, "ratio_median": statistics.median(r["ratio"] for r in rows),
            "batch_ms_tokens": batch_ms("tokens", str(prepared)), "batch_ms_synthetic": batch_ms("synthetic", None)}


def random_tokens(folder: Path, *, nbytes: int) -> Path:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    chunk = 1 << 26  # 64 MiB at a time
    with open(folder / "train.bin", "wb") as f:
        left = nbytes // 2
        while left:
            n = min(chunk // 2, left)
            rng.integers(0, 2048, n, dtype=np.uint16).tofile(f)
            left -= n
    rng.integers(0, 2048, 1 << 16, dtype=np.uint16).tofile(folder / "val.bin")
    meta = {"format": "dtk-tokens/1", "tokenizer": {"path": "tokenizer", "hash": "random"}, "vocab_size": 2048,
            "dtype": "uint16", "seq_len": 128, "train_tokens": nbytes // 2, "val_tokens": 1 << 16}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


RANK_DATA = """
import sys
from dtk.data.tokens import TokenFile

def hwm():  # this address space's peak RSS (ru_maxrss would carry the parent's over exec)
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))

before = hwm()
data = TokenFile(path=sys.argv[1], seq_len=128, seed=0, world=2)
built = hwm()
for step in range(int(sys.argv[2])):
    data.batch(step=step, rank=0, micro=0, size=16)
print(before, built, hwm())
"""


def part_memory(*, steps: int, workdir: Path) -> dict:
    """Per size: (a) a rank's data alone: a fresh process maps the file and draws `10 x steps` micro-batches, its
    peak RSS (VmHWM) before, after building, after drawing; (b) a whole `dtk train` run, summary peaks per rank.
    The files are written by a child process: a parent's peak RSS would be inherited by the ranks' ru_maxrss."""
    out = {}
    for label, nbytes in (("10MB", 10 * 10**6), ("1GB", 10**9)):
        folder = workdir / f"tokens-{label}"
        subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
                        f"import data; from pathlib import Path; data.random_tokens(Path({str(folder)!r}), "
                        f"nbytes={nbytes})"], check=True, env=env(), cwd=ROOT)
        try:
            p = subprocess.run([sys.executable, "-c", RANK_DATA, str(folder), str(10 * steps)], capture_output=True,
                               text=True, check=True, env=env(), cwd=ROOT)
            before, built, drawn = map(int, p.stdout.split())
            s = train(f"data.path={folder}", workdir=workdir, steps=steps)
        finally:
            shutil.rmtree(folder)  # the 1 GB file lives only for its runs
        out[label] = {"data_only_hwm": {"before": before, "built": built, "after_batches": drawn},
                      "data_only_growth_mb": (drawn - before) / 2**20, "train_peak_per_rank": s["peak_per_rank"],
                      "windows": (nbytes // 2 - 1) // 128}
        print(f"memory {label}: {out[label]}", flush=True)
    out["data_only_growth_mb"] = out["1GB"]["data_only_growth_mb"] - out["10MB"]["data_only_growth_mb"]
    out["growth_per_rank_mb"] = [(b - a) / 2**20 for a, b in zip(out["10MB"]["train_peak_per_rank"],
                                                                  out["1GB"]["train_peak_per_rank"])]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", type=Path, required=True, help="a folder of text files (.txt, .md)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--parts", default="prepare,speed,memory")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "data.json")
    a = p.parse_args()
    parts = a.parts.split(",")
    result: dict = {"load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="dtk-bench-data-") as tmp:
        work = Path(tmp)
        prepared = work / "prepared"
        if "prepare" in parts:
            result["prepare"] = part_prepare(a.corpus, reps=a.reps, workdir=work)
        if "speed" in parts:
            prepare(sources=[str(a.corpus)], out=str(prepared), tokenizer=None, train_tokenizer=2048, seq_len=128,
                    progress=False)
            result["speed"] = part_speed(prepared, reps=a.reps, steps=a.steps, workdir=work)
        if "memory" in parts:
            result["memory"] = part_memory(steps=a.steps, workdir=work)
    result["load_after"] = os.getloadavg()
    a.json.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v.get("ratio_median", v.get("growth_per_rank_mb")) if isinstance(v, dict) else v
                      for k, v in result.items()}, indent=1))


if __name__ == "__main__":
    main()
