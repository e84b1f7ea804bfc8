"""Split learning's data without processes: the Dirichlet split into clients, the clusters, each cluster's global
sampler (every sample of an epoch once; per-client counts add up to the batch), the CIFAR-10 binary reader, and
the recipe's one-line errors for gcpsl."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dtk import recipe as recipes
from dtk.data.cifar10 import MEAN, STD, Cifar10, read_batches
from dtk.data.clients import GlobalSampler, assign_clusters, build_federation, dirichlet_clients
from dtk.data.digits import Digits
from dtk.errors import DtkError

LABELS = Digits(seed=0, held_out=0.2).train_labels


def test_digits_held_out_split_is_disjoint_and_the_default_keeps_every_image():
    d = Digits(seed=0, held_out=0.2)
    assert len(d.test_labels) == 359 and len(d.train_labels) + len(d.test_labels) == 1797
    train = {tuple(x.flatten().tolist()) + (int(y),) for x, y in zip(d.train_images, d.train_labels)}
    test = [tuple(x.flatten().tolist()) + (int(y),) for x, y in zip(d.test_images, d.test_labels)]
    assert sum(t in train for t in test) < 10  # digits holds a few exact duplicates, no more
    whole = Digits(seed=0)
    assert len(whole.train_labels) == 1797 and len(whole.test_labels) == 0


@pytest.mark.parametrize("n", [96, 100])  # one epoch exactly, and one with samples left for the next
def test_global_sampler_draws_every_sample_of_an_epoch_once(n):
    indices = torch.arange(1000, 1000 + n)
    steps, batch = 3, 32
    sampler = GlobalSampler(indices, batch=batch, steps_per_epoch=steps, seed=0, cluster=1)
    for epoch in range(2):
        drawn = torch.cat([sampler.draw(epoch * steps + s) for s in range(steps)])
        assert len(drawn) == steps * batch and len(set(drawn.tolist())) == len(drawn), "a sample drawn twice"
        assert set(drawn.tolist()) <= set(indices.tolist())
        if n == steps * batch:
            assert sorted(drawn.tolist()) == indices.tolist()
    first = torch.cat([sampler.draw(s) for s in range(steps)])
    second = torch.cat([sampler.draw(steps + s) for s in range(steps)])
    assert not torch.equal(first, second), "each epoch is a new shuffle"
    assert torch.equal(sampler.draw(1), GlobalSampler(indices, batch=batch, steps_per_epoch=steps, seed=0,
                                                      cluster=1).draw(1)), "deterministic from the seed"


def test_a_cluster_smaller_than_an_epoch_goes_on_into_a_second_shuffle():
    sampler = GlobalSampler(torch.arange(40), batch=32, steps_per_epoch=2, seed=0, cluster=0)
    drawn = torch.cat([sampler.draw(0), sampler.draw(1)])
    assert sorted(drawn[:40].tolist()) == list(range(40))  # all of them once before any comes back


def test_per_client_batch_counts_sum_to_the_batch_size():
    fed = build_federation(LABELS, clients=64, clusters=4, assignment="random", alpha=0.3, batch=32, seed=0)
    for k in range(4):
        for step in range(2 * fed.global_epoch_steps):
            counts = fed.client_counts(k, step)
            assert int(counts.sum()) == 32
            # only the cluster's own clients give samples, each at most what it holds
            assert set(torch.nonzero(counts).flatten().tolist()) <= set(
                torch.nonzero(fed.cluster_of_client == k).flatten().tolist())
            assert bool((counts <= torch.bincount(fed.client_of, minlength=64)).all())


def test_dirichlet_split_gives_every_sample_a_client_and_small_alpha_skews_it():
    skewed = dirichlet_clients(LABELS, clients=32, alpha=0.1, seed=0)
    even = dirichlet_clients(LABELS, clients=32, alpha=100.0, seed=0)
    assert len(skewed) == len(LABELS) and int(skewed.min()) >= 0 and int(skewed.max()) < 32

    def classes_per_client(client_of):
        return np.mean([len(set(LABELS[client_of == c].tolist())) for c in range(32) if (client_of == c).any()])

    assert classes_per_client(skewed) < 5 < classes_per_client(even)
    assert torch.bincount(skewed).float().std() > 2 * torch.bincount(even).float().std()


def test_size_balanced_clusters_hold_equal_data_and_label_aware_similar_classes():
    client_of = dirichlet_clients(LABELS, clients=256, alpha=0.1, seed=0)

    def sizes(how):
        cluster_of = assign_clusters(client_of, LABELS, clients=256, clusters=4, how=how, seed=0)
        per_sample = cluster_of[client_of]
        return torch.bincount(per_sample, minlength=4), per_sample

    rand, _ = sizes("random")
    bal, _ = sizes("size_balanced")
    lab, per_sample = sizes("label_aware")
    assert int(bal.max() - bal.min()) <= 5 < int(rand.max() - rand.min())
    hist = torch.stack([torch.bincount(LABELS[per_sample == k], minlength=10) for k in range(4)]).float()
    ideal = torch.bincount(LABELS, minlength=10).float() / 4
    assert float((hist - ideal).abs().max()) <= 12  # every class within a few samples of an equal share


def test_direct_participation_is_higher_with_size_balanced_clusters():
    def participation(how):
        fed = build_federation(LABELS, clients=256, clusters=4, assignment=how, alpha=0.1, batch=32, seed=0)
        seen = torch.zeros(len(LABELS), dtype=torch.bool)
        for sampler in fed.samplers:
            for step in range(fed.global_epoch_steps):
                seen[sampler.draw(step)] = True
        return float(seen.float().mean())

    assert participation("size_balanced") > participation("random")


def _write_cifar(path, labels, seed):
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (len(labels), 3072), dtype=np.uint8)
    rows = np.concatenate([np.array(labels, np.uint8)[:, None], pixels], axis=1)
    rows.tofile(path)
    return pixels


def test_cifar10_reader_on_a_tiny_file_in_the_binary_format(tmp_path):
    p1 = _write_cifar(tmp_path / "data_batch_1.bin", [3, 7, 0], seed=1)
    p2 = _write_cifar(tmp_path / "data_batch_2.bin", [9, 1], seed=2)
    pt = _write_cifar(tmp_path / "test_batch.bin", [5, 5, 2, 8], seed=3)
    images, labels = read_batches([tmp_path / "data_batch_1.bin"])
    assert images.shape == (3, 3, 32, 32) and images.dtype == torch.uint8 and labels.tolist() == [3, 7, 0]
    # record layout: 1,024 red, then green, then blue bytes, each plane row by row
    assert int(images[1, 0, 0, 0]) == p1[1, 0] and int(images[1, 1, 0, 0]) == p1[1, 1024]
    assert int(images[1, 2, 31, 31]) == p1[1, 3071] and int(images[2, 0, 1, 0]) == p1[2, 32]

    data = Cifar10(path=str(tmp_path), seed=0)
    assert data.train_labels.tolist() == [3, 7, 0, 9, 1] and data.test_labels.tolist() == [5, 5, 2, 8]
    assert data.spec.input_shape == (3, 32, 32) and data.spec.classes == 10
    want = (p2[0, 1024] / 255 - MEAN[0, 1, 0, 0]) / STD[0, 1, 0, 0]
    assert float(data.train_images[3, 1, 0, 0]) == pytest.approx(float(want), rel=1e-6)
    assert float(data.test_images[2, 0, 0, 5]) == pytest.approx(float((pt[2, 5] / 255 - MEAN[0, 0, 0, 0]) / STD[0, 0, 0, 0]), rel=1e-6)
    x, y = data.batch(step=0, rank=0, micro=0, size=4)
    assert x.shape == (4, 3, 32, 32) and set(y.tolist()) <= {3, 7, 0, 9, 1}


def test_cifar10_reader_refuses_a_file_that_is_not_whole_records(tmp_path):
    (tmp_path / "data_batch_1.bin").write_bytes(b"\x01" * 3000)
    (tmp_path / "test_batch.bin").write_bytes(b"\x01" * 3073)
    with pytest.raises(DtkError, match="data.path.*3073-byte CIFAR-10 records"):
        Cifar10(path=str(tmp_path), seed=0)


def _errors(*overrides: str) -> list[str]:
    base = ["model.name=resnet", "data.name=digits", "data.held_out=0.2", "strategy.name=gcpsl"]
    with pytest.raises(DtkError) as info:
        recipes.build({}, [*base, *overrides])
    return info.value.lines


@pytest.mark.parametrize("overrides, words", [
    (["data.name=synthetic", "model.name=gpt"], ["data.name", "'synthetic'", "digits, cifar10"]),
    (["data.held_out=0"], ["data.held_out", "held-out accuracy"]),
    (["strategy.clients=3", "world.nproc=4", "strategy.clusters=4"], ["strategy.clusters", "strategy.clients (3)"]),
    (["strategy.clusters=3", "world.nproc=2"], ["strategy.clusters", "world.nproc (2)", "gcpsl_serial"]),
    (["strategy.name=gcpsl_serial", "world.nproc=2"], ["world.nproc", "gcpsl_serial", "accepted: 1"]),
    (["strategy.cut=4", "model.layers=2"], ["strategy.cut", "resnet", "1..3"]),
    (["training.grad_accum=2"], ["training.grad_accum", "accepted: 1"]),
    (["data.name=cifar10", "data.path=/no/such/folder"], ["data.path", "no such folder"]),
    (["strategy.assignment=even"], ["strategy.assignment", "size_balanced"]),
])
def test_gcpsl_recipe_mistakes_are_one_line_each(overrides, words):
    lines = _errors(*overrides)
    assert len(lines) == 1, lines
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_a_good_gcpsl_recipe_validates_and_clusters_default_to_ranks():
    r = recipes.build({}, ["model.name=resnet", "data.name=digits", "data.held_out=0.2", "strategy.name=gcpsl",
                           "world.nproc=3"])
    assert r.strategy.clusters is None and r.strategy.clients == 256 and r.strategy.merge_every == 5
    recipes.load(recipes.Path(__file__).parents[2] / "recipes" / "gcpsl.yaml")
