"""Any checkpoint of any strategy -> one model others can load (safetensors, a save_pretrained folder, torch), on
one process; and `final/`, which every run leaves at its end by the same path (a DCP save, then this export).

A checkpoint is read with torch.distributed.checkpoint on one process (no ranks): DDP's and FSDP's hold the model
under its parameter names, ZeRO's under `zero.master.<name>` as flat fp32 tensors (dtk.strategies.zero_checkpoint),
so the result is the full, unsharded fp32 model whatever the strategy and rank count that wrote it.
"""
from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Literal, Protocol, TypeGuard, cast

import torch
from torch import nn

from dtk import recipe as recipes
from dtk.errors import DtkError
from dtk.resilience import checkpoint

log = logging.getLogger(__name__)
Format = Literal["safetensors", "hf", "torch"]
FORMATS: tuple[str, ...] = ("safetensors", "hf", "torch")


def is_format(value: str) -> TypeGuard[Format]:
    """`value` is one of FORMATS (for a str the CLI took)."""
    return value in FORMATS


ZERO_MASTER = "engine.zero.master."
ZERO_BUFFER = "engine.zero.buffer."


class _SavesPretrained(Protocol):
    """A transformers model (model.hf): what fmt "hf" writes with."""

    def save_pretrained(self, save_directory: str) -> None: ...


def _model_of(r: recipes.Recipe) -> nn.Module:
    from dtk.data import build_dataset
    from dtk.models import build_model

    return build_model(r.model, build_dataset(r.data, seed=r.training.seed).spec, seed=r.training.seed)


def load_model(r: recipes.Recipe, state_dir: Path) -> nn.Module:
    """The recipe's model, on this process, holding the weights of the DCP checkpoint in `state_dir`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    # one process reads every rank's shards; DCP warns that no process group is there, which is the point
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    keys = set(FileSystemReader(str(state_dir)).read_metadata().state_dict_metadata)
    model = _model_of(r)
    if any(k.startswith("engine.clusters.") for k in keys):
        raise DtkError(f"checkpoint: {str(state_dir)!r} is a {r.strategy.name} checkpoint, one model per cluster of "
                       "clients; accepted: a checkpoint of ddp, fsdp, zero1, zero2 or zero3")
    if any(k.startswith(ZERO_MASTER) for k in keys):
        params = dict(model.named_parameters())
        flat = {f"zero.master.{n}": torch.empty(p.numel(), dtype=torch.float32) for n, p in params.items()}
        flat |= {f"zero.buffer.{n}": b.detach().clone() for n, b in model.named_buffers()
                 if f"{ZERO_BUFFER}{n}" in keys}
        dcp.load({"engine": flat}, checkpoint_id=str(state_dir), no_dist=True)
        state = {n: flat[f"zero.master.{n}"].view(p.shape) for n, p in params.items()}
        state |= {k[len("zero.buffer."):]: v for k, v in flat.items() if k.startswith("zero.buffer.")}
    else:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        dcp.load({"engine": {"model": state}}, checkpoint_id=str(state_dir), no_dist=True)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {n for n, p in model.named_parameters(remove_duplicate=False)} - set(dict(model.named_parameters()))
    if unexpected or set(missing) - tied - {n for n, _ in model.named_buffers()}:
        raise AssertionError(f"checkpoint {state_dir} does not fit the recipe's model: missing {missing}, "
                             f"unexpected {unexpected}")
    return model.eval()


def _tokenizer_dir(r: recipes.Recipe) -> Path | None:
    """Prepared token data (data.name tokens) keeps the tokenizer that made it in <data.path>/tokenizer/."""
    if r.data.name == "tokens" and r.data.path and (Path(r.data.path) / "tokenizer").is_dir():
        return Path(r.data.path) / "tokenizer"
    return None


def write(model: nn.Module, r: recipes.Recipe, out: Path, *, fmt: Format) -> None:
    """Write `model` in `fmt` into the new folder `out` (made whole in a sibling, then renamed), with recipe.yaml."""
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if fmt == "safetensors":
            from safetensors.torch import save_model

            save_model(model, str(tmp / "model.safetensors"))  # tied weights once, as safetensors wants
        elif fmt == "torch":
            torch.save(model.state_dict(), tmp / "model.pt")
        else:
            # nn.Module's __getattr__ types an attribute it does not declare as Tensor | Module
            cast(_SavesPretrained, model).save_pretrained(str(tmp))
            if tok := _tokenizer_dir(r):
                for f in tok.iterdir():
                    if f.is_file():
                        shutil.copy2(f, tmp / f.name)
        (tmp / "recipe.yaml").write_text(recipes.dump(r))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_final(engine, *, r: recipes.Recipe, run_dir: str | Path, step: int, rank: int, checkpointed: bool) -> None:
    """Every rank, at the end of a run: final/ with model.safetensors and recipe.yaml, and hf/ for model.hf. The
    state goes through a DCP save (the checkpoint of this step when the run has one: `checkpointed`) and export on
    rank 0, so final/ holds exactly what `dtk export` makes of a checkpoint. `checkpointed` comes from the recipe and
    the step, the same on every rank: read from the folder, the ranks once chose differently (rank 0 writes the
    checkpoint's manifest after the save, and a rank that looked before it saved alone)."""
    import torch.distributed.checkpoint as dcp

    run_dir = Path(run_dir)
    staging = run_dir / ".final-state"
    source = checkpoint.checkpoint_dir(run_dir) / f"step_{step}" if checkpointed else staging
    if source == staging:
        dcp.save({"engine": engine.checkpoint_state(), "step": torch.tensor(step)}, checkpoint_id=str(staging))
    if rank == 0:
        lacking = checkpoint.missing_files(source)
        if lacking:  # several hosts, each with its own run folder: the other ranks' shards are on their disks
            log.warning("output.save_final: no final/ written: %s (a run folder not shared by every node); "
                        "dtk export RUN_DIR on a folder that holds every node's files makes it", lacking)
            shutil.rmtree(staging, ignore_errors=True)
            return
        model = load_model(r, source)
        final = run_dir / "final"
        write(model, r, final, fmt="safetensors")
        if r.model.hf is not None:
            write(model, r, final / "hf", fmt="hf")
        shutil.rmtree(staging, ignore_errors=True)
        log.info("final model of step %d written to %s", step, final)


def run_folder_checkpoint(run_dir: Path, step: int | None) -> tuple[recipes.Recipe, Path | None]:
    """(the run's recipe, the checkpoint to export: step_N, or the newest; None = the run's final/)."""
    if not (run_dir / "recipe.yaml").is_file():
        raise DtkError(f"RUN_DIR: got {str(run_dir)!r}; no recipe.yaml in it, so it is no dtk run folder; accepted: "
                       "the output.dir of a dtk train")
    r = recipes.load(run_dir / "recipe.yaml")
    steps = sorted(int(p.name[5:]) for p in checkpoint.checkpoint_dir(run_dir).glob("step_*")
                   if p.name[5:].isdigit() and (p / ".metadata").is_file())
    has_final = (run_dir / "final" / "model.safetensors").is_file()
    if step is not None:
        if step not in steps:
            raise DtkError(f"--step: got {step}; {run_dir} has no checkpoint of that step; accepted: "
                           f"{', '.join(map(str, steps)) or 'none (it has no checkpoint; leave out --step)'}")
        return r, checkpoint.checkpoint_dir(run_dir) / f"step_{step}"
    if has_final:
        return r, None
    if not steps:
        raise DtkError(f"RUN_DIR: got {str(run_dir)!r}; it holds no checkpoint and no final/ model; accepted: a run "
                       "folder with checkpoints (checkpoint.every) or one that finished (output.save_final)")
    return r, checkpoint.checkpoint_dir(run_dir) / f"step_{steps[-1]}"


def export(run_dir: Path, *, step: int | None, fmt: Format, out: Path) -> tuple[recipes.Recipe, str]:
    """`dtk export`: returns the recipe and what was exported (for the line the CLI prints)."""
    r, source = run_folder_checkpoint(run_dir, step)
    if fmt == "hf" and r.model.hf is None:
        raise DtkError(f"--format: got 'hf'; the run's model is not a transformers model (model.hf); accepted: "
                       "safetensors, torch")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DtkError(f"--out: got {str(out)!r}; it exists and is not an empty folder; accepted: a new folder")
    if source is None:
        from safetensors.torch import load_model as read_safetensors

        model = _model_of(r)
        read_safetensors(model, str(run_dir / "final" / "model.safetensors"))
        what = f"{run_dir / 'final'}"
    else:
        model, what = load_model(r, source), str(source)
    write(model.eval(), r, out, fmt=fmt)
    return r, what
