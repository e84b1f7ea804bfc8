"""Checkpoints resume on another rank count, under every strategy: real ranks on gloo, real DCP, real DeepSpeed.

Three spawns in a row (2 ranks, 3 ranks, 2 ranks) train, save, and load each strategy's checkpoint on the other
count (2 -> 3, then 3 -> 2). A checkpoint loaded from the other count and saved again holds every tensor bit for bit
(weights, fp32 masters, Adam moments, step), and training on from it gives the losses, bit for bit, of training
on from that same state saved by the new count itself. Cross-strategy loads where the state means the same (3 -> 2):
ddp -> fsdp, zero2 -> zero3."""
from __future__ import annotations

import datetime
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from dtk.rendezvous import free_port

pytestmark = [pytest.mark.dist]
STRATEGIES = ["ddp", "fsdp", "zero2", "zero3"]  # zero3 last: DeepSpeed's stage 3 leaves hooks behind
CROSS = {"fsdp": "ddp", "zero3": "zero2"}
"""A strategy that also loads another's checkpoint (saved by the other rank count)."""
OVERRIDES = ["model.layers=1", "model.width=32", "model.heads=2", "data.seq_len=16", "data.vocab_size=32",
             "training.micro_batch=4", "training.steps=8", "optimizer.weight_decay=0.1",
             "optimizer.schedule=cosine", "optimizer.warmup_steps=2"]


def _train(engine, data, r, rank: int, steps: range) -> list[float]:
    from dtk.schedule import lr_at, set_lr

    out = []
    for step in steps:
        x, y = data.batch(step=step, rank=rank, micro=0, size=r.training.micro_batch)
        out.append(float(engine.forward_backward(x, y, last_micro=True)))
        set_lr(engine.param_groups(), lr_at(step, cfg=r.optimizer, total_steps=r.training.steps))
        engine.optimizer_step()
    return out


def _rank_main(rank: int, world: int, port: int, phase: int, root: str, results) -> None:
    os.environ.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from dtk import recipe
    from dtk.comm.group import register
    from dtk.data import build_dataset
    from dtk.models import build_model
    from dtk.resilience import checkpoint
    from dtk.strategies import BuildContext, build_engine

    register()
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("dtk", store=store, rank=rank, world_size=world)
    root_dir, out = Path(root), {}

    def engine_for(strategy: str):
        r = recipe.build({}, [*OVERRIDES, f"strategy.name={strategy}"])
        data = build_dataset(r.data, seed=0)
        ctx = BuildContext(model_factory=lambda: build_model(r.model, data.spec, seed=0), recipe=r,
                           group=dist.group.WORLD, device=torch.device("cpu"))
        return build_engine(strategy, ctx), data, r

    for strategy in STRATEGIES:
        here = root_dir / strategy / f"w{world}"
        if phase == 0:  # 2 ranks: train 2 steps from scratch, save
            engine, data, r = engine_for(strategy)
            _train(engine, data, r, rank, range(0, 2))
            checkpoint.save(engine, step=2, run_dir=here, keep=3)
            continue
        start = 2 if phase == 1 else 4
        sources = {strategy: strategy, **({"cross": CROSS[strategy]} if strategy in CROSS and phase == 2 else {})}
        for label, source in sources.items():
            # the other count's checkpoint: load it, save it in this count's layout, train on
            engine, data, r = engine_for(strategy)
            x, y = data.batch(step=start, rank=rank, micro=0, size=r.training.micro_batch)
            engine.match_running_layout(x, y)  # as a resumed rank does (dtk.worker)
            other = root_dir / source / f"w{5 - world}" / "checkpoints" / f"step_{start}"
            assert checkpoint.load(engine, other) == start
            resaved = root_dir / f"{label}-{strategy}" / f"w{world}"
            checkpoint.save(engine, step=start, run_dir=resaved, keep=3)
            loaded = _train(engine, data, r, rank, range(start, start + 2))
            # the same state as this count saved it, loaded into the engine again: training on gives the same
            checkpoint.load(engine, resaved / "checkpoints" / f"step_{start}")
            own = _train(engine, data, r, rank, range(start, start + 2))
            out[f"{label}/{strategy}"] = {"loaded": loaded, "own": own, "from": str(other),
                                          "resaved": str(resaved / "checkpoints" / f"step_{start}")}
            if phase == 1:  # the state after step 4, for the 3 -> 2 phase
                checkpoint.save(engine, step=4, run_dir=here, keep=3)
    results[rank] = out
    dist.destroy_process_group()


def _spawn(world: int, phase: int, root: Path) -> dict:
    results = mp.Manager().dict()
    mp.start_processes(_rank_main, args=(world, free_port(), phase, str(root), results), nprocs=world,
                       start_method="spawn")
    return dict(results)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    _spawn(2, 0, root)
    return {"2->3": _spawn(3, 1, root), "3->2": _spawn(2, 2, root)}  # ~50 s on 2 idle cores


def _read(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole, read on this process."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    import torch.distributed.checkpoint as dcp

    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if isinstance(m, TensorStorageMetadata)}
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


@pytest.mark.timeout(600)
@pytest.mark.parametrize("way", ["2->3", "3->2"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_checkpoint_resumes_on_another_rank_count(resumed, way, strategy):
    got = resumed[way][0][f"{strategy}/{strategy}"]
    assert got["loaded"] == got["own"], f"{strategy} {way}: the loaded run drifts from the same state's run"
    saved, resaved = _read(got["from"]), _read(got["resaved"])
    assert sorted(saved) == sorted(resaved)
    assert any(".exp_avg_sq." in k or k.endswith(".exp_avg_sq") for k in saved), sorted(saved)[:8]
    for key in saved:
        assert torch.equal(saved[key], resaved[key]), f"{strategy} {way}: {key} changed in the load"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_export_of_a_3_rank_checkpoint_is_the_model_it_trained(resumed, strategy, tmp_path):
    """The built-in gpt's checkpoint of step 4 on 3 ranks, exported on one process to safetensors and read back into
    a gpt: on rank 0's batch of step 4 it gives the loss the 2-rank run resumed from that checkpoint computed."""
    from safetensors.torch import load_model

    from dtk import export, recipe
    from dtk.data import build_dataset
    from dtk.models import build_model
    from dtk.strategies.base import loss_fn

    r = recipe.build({}, [*OVERRIDES, f"strategy.name={strategy}"])
    written = export.load_model(r, Path(resumed["3->2"][0][f"{strategy}/{strategy}"]["from"]))
    export.write(written, r, tmp_path / "out", fmt="safetensors")
    data = build_dataset(r.data, seed=0)
    model = build_model(r.model, data.spec, seed=1)  # another seed: every weight must come from the file
    load_model(model, str(tmp_path / "out" / "model.safetensors"))
    x, y = data.batch(step=4, rank=0, micro=0, size=r.training.micro_batch)
    with torch.no_grad():
        loss = float(loss_fn(model(x), y))
    assert loss == pytest.approx(resumed["3->2"][0][f"{strategy}/{strategy}"]["loaded"][0], rel=1e-6)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy, source", sorted(CROSS.items()))
def test_a_checkpoint_of_another_strategy_with_the_same_state_loads(resumed, strategy, source):
    got = resumed["3->2"][0][f"cross/{strategy}"]
    assert got["loaded"] == got["own"]
    own = resumed["3->2"][0][f"{source}/{source}"]["loaded"]  # the source strategy trained on from its own state
    assert got["loaded"] == pytest.approx(own, rel=1e-5)
