"""Where rank 0's per-step records go besides metrics.jsonl: TensorBoard, CSV, W&B and MLflow, all into the run
folder (W&B offline, MLflow on a file: store; nothing is sent). Each logger sees the record's numbers only."""
from __future__ import annotations

import csv
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Protocol

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""The package a logger needs (jsonl and csv need none), and the pip extra of the same name that installs it."""
CSV_FIELDS = ["step", "loss", "lr", "grad_norm", "step_seconds", "samples_per_second", "tokens_per_second",
              "peak_memory_bytes", "generation", "time"]


class Logger(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def missing_packages(names: list[str]) -> list[str]:
    """The loggers of `names` whose package is not importable here (a None in sys.modules blocks one, as Python
    documents)."""
    out = []
    for name in names:
        pkg = PACKAGES.get(name)
        if pkg is None:
            continue
        absent = sys.modules[pkg] is None if pkg in sys.modules else importlib.util.find_spec(pkg) is None
        if absent:
            out.append(name)
    return out


def scalars_of(record: dict) -> dict[str, float]:
    """The plottable numbers of a step's record: its top-level numbers, peak memory as the largest rank's."""
    out = {k: float(v) for k, v in record.items()
           if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "time")}
    if record.get("peak_memory_bytes"):
        out["peak_memory_bytes"] = float(max(record["peak_memory_bytes"]))
    return out


class TensorBoardLogger:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(f"train/{key}", value, step)

    def close(self) -> None:
        self.writer.close()


class CSVLogger:
    """metrics.csv, one row a step; a resumed run drops the rows of the steps it redoes (as metrics.jsonl)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "metrics.csv"

    def truncate_from(self, step: int) -> None:
        if self.path.exists():
            with open(self.path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) < step]
            self._rewrite(rows)

    def _rewrite(self, rows: list[dict]) -> None:
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            w.writeheader()
            w.writerows(rows)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if not self.path.exists():
            self._rewrite([])
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore").writerow({"step": step, **scalars})

    def close(self) -> None:
        pass


class WandbLogger:
    def __init__(self, run_dir: Path, config: dict):
        os.environ["WANDB_MODE"] = "offline"  # files under run_dir/wandb; `wandb sync` uploads them, if one wants
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self.run = wandb.init(project="dtk", dir=str(run_dir), name=run_dir.name, config=config, mode="offline")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log({f"train/{k}": v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflowLogger:
    def __init__(self, run_dir: Path, config: dict):
        # a file: store in the run folder; MLflow 3 keeps it in maintenance mode and wants this to open one
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
        found = self.client.get_experiment_by_name("dtk")
        experiment = found.experiment_id if found else self.client.create_experiment("dtk")
        self.run_id = self.client.create_run(experiment, run_name=run_dir.name).info.run_id
        for section, fields in config.items():
            for key, value in (fields.items() if isinstance(fields, dict) else []):
                self.client.log_param(self.run_id, f"{section}.{key}", str(value)[:500])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def build(names: list[str], *, run_dir: str | Path, config: dict) -> list[Logger]:
    """The loggers of `output.loggers` besides jsonl (which dtk.metrics always writes)."""
    run_dir = Path(run_dir)
    made: dict[str, Logger] = {}
    for name in dict.fromkeys(names):
        if name == "tensorboard":
            made[name] = TensorBoardLogger(run_dir)
        elif name == "csv":
            made[name] = CSVLogger(run_dir)
        elif name == "wandb":
            made[name] = WandbLogger(run_dir, config)
        elif name == "mlflow":
            made[name] = MLflowLogger(run_dir, config)
    return list(made.values())
