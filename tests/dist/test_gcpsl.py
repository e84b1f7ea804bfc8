"""GCPSL on real ranks: a merge leaves every cluster holding the data-size weighted average, bit for bit the same
on every rank and counted at the seam; gcpsl learns the digits, gives gcpsl_serial's models exactly, and resumes
from a checkpoint exactly."""
from __future__ import annotations

import datetime
import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from conftest import RECIPES, read_jsonl, run_dtk
from dtk.rendezvous import free_port

pytestmark = [pytest.mark.dist]
GCPSL = RECIPES / "gcpsl.yaml"


def _rank_main(rank: int, world: int, port: int, results) -> None:
    os.environ.update(OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from dtk import recipe
    from dtk.comm.group import Seam, register
    from dtk.data import build_dataset
    from dtk.models import build_model
    from dtk.strategies import BuildContext, build_engine

    register()
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("dtk", store=store, rank=rank, world_size=world)
    r = recipe.load(GCPSL, [f"world.nproc={world}", f"strategy.clusters={world}", "strategy.merge_every=100",
                            "strategy.clients=32", "model.width=8"])
    data = build_dataset(r.data, seed=0)
    ctx = BuildContext(model_factory=lambda: build_model(r.model, data.spec, seed=0), recipe=r,
                       group=dist.group.WORLD, device=torch.device("cpu"))
    engine = build_engine("gcpsl", ctx)
    for _ in range(3):  # no merge yet: each cluster trains on its own clients' data
        engine.forward_backward(None, None, last_micro=True)
        engine.optimizer_step()
    (workload,) = engine.workloads.values()
    before = torch.cat([p.detach().flatten().clone() for p in workload.params])
    Seam.stats.take()
    engine.merge()
    comm = Seam.stats.take()
    after = torch.cat([p.detach().flatten().clone() for p in workload.params])
    results[rank] = {"before": before, "after": after, "weight": engine.weights[rank], "comm": comm,
                     "sizes": engine.federation.cluster_sizes}
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_after_a_merge_every_cluster_holds_the_weighted_average_bit_for_bit_on_every_rank():
    world = 3
    results = mp.Manager().dict()
    mp.start_processes(_rank_main, args=(world, free_port(), results), nprocs=world, start_method="spawn")
    got = [results[r] for r in range(world)]
    sizes = got[0]["sizes"]
    assert len(set(sizes)) > 1, "clusters of unequal sizes, so the weights matter"
    assert [g["weight"] for g in got] == pytest.approx([n / sum(sizes) for n in sizes])
    assert not torch.equal(got[0]["before"], got[1]["before"]), "the clusters had drifted apart before the merge"
    for g in got[1:]:
        assert torch.equal(g["after"], got[0]["after"]), "ranks disagree after the merge"
    want = sum(g["before"].double() * g["weight"] for g in got)
    assert torch.allclose(got[0]["after"].double(), want, rtol=1e-6, atol=1e-7)
    # the merge went through the seam: one all-reduce of every parameter, in the byte counters
    numel = got[0]["before"].numel()
    for g in got:
        kind = g["comm"]["by_kind"]["all_reduce"]
        assert kind["calls"] == 1 and kind["size_bytes"] == 4 * numel
        assert kind["bytes"] == pytest.approx(4 * numel * 2 * (world - 1) / world)


def _train(run_dir, *overrides: str):
    p = run_dtk("train", GCPSL, f"output.dir={run_dir}", *overrides, "--no-progress", timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    return read_jsonl(run_dir / "metrics.jsonl"), json.loads((run_dir / "summary.json").read_text())


def _merged_accuracies(records: list[dict]) -> list[float]:
    return [r["accuracy"] for r in records if r["merged"]]


TWO = ["strategy.clusters=2", "training.steps=40"]


@pytest.fixture(scope="module")
def two_clusters(tmp_path_factory):
    """2 clusters of 128 non-IID clients for 40 steps, merged every 5: gcpsl on 2 ranks (made on first use)."""
    return _train(tmp_path_factory.mktemp("gcpsl") / "run", "world.nproc=2", *TWO)


@pytest.mark.timeout(300)
def test_gcpsl_learns_the_digits_and_gives_exactly_the_serial_models(tmp_path, two_clusters):
    par, par_summary = two_clusters
    ser, ser_summary = _train(tmp_path / "serial", "strategy.name=gcpsl_serial", "world.nproc=1", *TWO)
    assert len(par) == len(ser) == 40
    assert par_summary["accuracy"] >= 0.75, _merged_accuracies(par)  # held-out, after 40 steps
    assert _merged_accuracies(par) == _merged_accuracies(ser)  # the same models after every merge, bit for bit
    assert [r["loss"] for r in par] == pytest.approx([r["loss"] for r in ser], rel=1e-6)
    assert par_summary["comm"]["by_kind"]["all_reduce"]["bytes_per_step"] > 0
    assert "all_reduce" not in ser_summary["comm"]["by_kind"]
    assert par_summary["time_to_target_s"] is None or par_summary["time_to_target_s"] > 0
    for summary in (par_summary, ser_summary):
        assert 0.9 < summary["participation"] <= 1.0
        assert summary["target_accuracy"] == 0.9
    assert 0 < par[-1]["participation"] <= 1 and par[-1]["cut_bytes"] > 0


@pytest.mark.timeout(300)
def test_gcpsl_with_one_cluster_is_gcpsl_serial_with_one_cluster(tmp_path):
    one = ["world.nproc=1", "strategy.clusters=1", "training.steps=10", "training.target_accuracy=0.1"]
    par, par_summary = _train(tmp_path / "gcpsl", *one)
    ser, ser_summary = _train(tmp_path / "serial", "strategy.name=gcpsl_serial", *one)
    assert [r["loss"] for r in par] == [r["loss"] for r in ser]
    assert _merged_accuracies(par) == _merged_accuracies(ser) and len(_merged_accuracies(par)) == 2
    assert par_summary["time_to_target_s"] > 0 and ser_summary["time_to_target_s"] > 0


@pytest.mark.timeout(300)
def test_gcpsl_resumes_from_a_checkpoint_exactly(tmp_path, two_clusters):
    want = two_clusters[0][:14]
    run_dir = tmp_path / "resumed"
    _train(run_dir, "world.nproc=2", "strategy.clusters=2", "training.steps=12", "checkpoint.every=5")
    got, _ = _train(run_dir, "world.nproc=2", "strategy.clusters=2", "training.steps=14")  # resumes from step 10
    assert "at step 10" in (run_dir / "logs" / "rank0.log").read_text()
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    # merged models after steps 5 and 10 (a 14-step run also merges after its last step)
    assert _merged_accuracies(got[:13]) == _merged_accuracies(want[:13]) and len(_merged_accuracies(want)) == 2


@pytest.mark.timeout(300)
def test_gcpsl_serial_trains_a_resnet_on_cifar10_binary_batches_from_a_folder(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    for name, n in (("data_batch_1.bin", 120), ("data_batch_2.bin", 80), ("test_batch.bin", 40)):
        rows = np.concatenate([rng.integers(0, 10, (n, 1)), rng.integers(0, 256, (n, 3072))], axis=1)
        rows.astype(np.uint8).tofile(tmp_path / name)
    records, summary = _train(tmp_path / "run", "data.name=cifar10", f"data.path={tmp_path}", "model.width=8",
                              "strategy.name=gcpsl_serial", "world.nproc=1", "strategy.clusters=2",
                              "strategy.clients=8", "training.micro_batch=16", "training.steps=3")
    assert len(records) == 3 and summary["status"] == "completed"
    assert records[-1]["merged"] and summary["accuracy"] is not None  # on the 40 test images
    # no epoch (200 // (2 x 16) = 6 steps) completed: the running share, at most 3 steps x 2 x 16 of 200
    assert 0 < summary["participation"] <= 96 / 200
