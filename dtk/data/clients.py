"""Split-learning clients over a labelled image set: a Dirichlet (non-IID) split into clients, the clients' fixed
assignment to clusters, and each cluster's global sampler (one shuffle of the cluster's data per epoch)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dtk.errors import DtkError


def dirichlet_clients(labels: torch.Tensor, *, clients: int, alpha: float, seed: int) -> torch.Tensor:
    """The client of every sample: each class is shared out over the clients in proportions drawn from
    Dirichlet(alpha); a small alpha gives clients few classes and very unequal sizes."""
    rng = np.random.default_rng(seed)
    y = labels.numpy()
    client_of = np.empty(len(y), dtype=np.int64)
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        rng.shuffle(idx)
        share = rng.dirichlet(np.full(clients, alpha))
        cuts = np.round(np.cumsum(share)[:-1] * len(idx)).astype(np.int64)
        counts = np.diff(np.concatenate([[0], cuts, [len(idx)]]))
        client_of[idx] = np.repeat(np.arange(clients), counts)
    return torch.from_numpy(client_of)


def assign_clusters(client_of: torch.Tensor, labels: torch.Tensor, *, clients: int, clusters: int, how: str,
                    seed: int) -> torch.Tensor:
    """The cluster of every client. random: equal numbers of clients per cluster, drawn at random.
    size_balanced: largest client first into the cluster with the least data (equal data sizes).
    label_aware: largest client first into the cluster whose class histogram it brings closest to an equal
    share of the global one (equal sizes and similar label mixes)."""
    rng = np.random.default_rng(seed + 1)
    if how == "random":
        order = rng.permutation(clients)
        cluster_of = np.empty(clients, dtype=np.int64)
        cluster_of[order] = np.arange(clients) % clusters
        return torch.from_numpy(cluster_of)
    classes = int(labels.max()) + 1
    hist = np.zeros((clients, classes))
    np.add.at(hist, (client_of.numpy(), labels.numpy()), 1)
    sizes = hist.sum(1)
    ideal = hist.sum(0) / clusters
    held = np.zeros((clusters, classes))
    cluster_of = np.empty(clients, dtype=np.int64)
    for c in np.argsort(-sizes, kind="stable"):
        if how == "size_balanced":
            k = int(np.argmin(held.sum(1)))
        else:
            k = int(np.argmin(np.abs(held + hist[c] - ideal).sum(1) - np.abs(held - ideal).sum(1)))
        held[k] += hist[c]
        cluster_of[c] = k
    return torch.from_numpy(cluster_of)


class GlobalSampler:
    """One cluster's GPSL sampler: each epoch (of a fixed number of steps, the same for every cluster) starts from a
    fresh seeded shuffle of all the cluster's samples, cut into batches in order: no sample is drawn twice in an
    epoch while the shuffle lasts, and a client's share of a batch follows its data size. A cluster with fewer
    samples than an epoch draws goes on into a second shuffle; one with more leaves the rest out of that epoch."""

    def __init__(self, indices: torch.Tensor, *, batch: int, steps_per_epoch: int, seed: int, cluster: int):
        self.indices, self.batch, self.steps_per_epoch = indices, batch, steps_per_epoch
        self.seed, self.cluster = seed, cluster
        self._orders: dict[tuple[int, int], torch.Tensor] = {}

    def order(self, epoch: int, rounds: int = 0) -> torch.Tensor:
        """The shuffle an epoch draws from (`rounds` > 0: the next ones, for a cluster smaller than an epoch)."""
        key = (epoch, rounds)
        if key not in self._orders:
            g = torch.Generator().manual_seed(((self.seed * 1_000_003 + self.cluster) * 65_537 + epoch) * 131 + rounds)
            self._orders = {k: v for k, v in self._orders.items() if k[0] == epoch}
            self._orders[key] = self.indices[torch.randperm(len(self.indices), generator=g)]
        return self._orders[key]

    def draw(self, step: int) -> torch.Tensor:
        """The sample indices of this cluster's batch at `step`."""
        epoch, within = divmod(step, self.steps_per_epoch)
        n, out = len(self.indices), []
        pos, end = within * self.batch, (within + 1) * self.batch
        while pos < end:
            rounds, off = divmod(pos, n)
            take = min(end - pos, n - off)
            out.append(self.order(epoch, rounds)[off:off + take])
            pos += take
        return torch.cat(out)


@dataclass(kw_only=True)
class Federation:
    """Clients, clusters and samplers over one training set; every rank builds the same one from the seed."""

    client_of: torch.Tensor
    cluster_of_client: torch.Tensor
    samplers: list[GlobalSampler]
    global_epoch_steps: int
    """Steps of an epoch, in which all clusters together draw as many samples as there are: N // (clusters x batch),
    at least 1. Direct participation is the share of samples drawn at least once within one epoch."""

    @property
    def cluster_sizes(self) -> list[int]:
        return [len(s.indices) for s in self.samplers]

    def client_counts(self, cluster: int, step: int) -> torch.Tensor:
        """How many samples each client gives to this cluster's batch at `step`."""
        return torch.bincount(self.client_of[self.samplers[cluster].draw(step)], minlength=len(self.cluster_of_client))


def build_federation(labels: torch.Tensor, *, clients: int, clusters: int, assignment: str, alpha: float,
                     batch: int, seed: int) -> Federation:
    client_of = dirichlet_clients(labels, clients=clients, alpha=alpha, seed=seed)
    cluster_of_client = assign_clusters(client_of, labels, clients=clients, clusters=clusters, how=assignment,
                                        seed=seed)
    cluster_of_sample = cluster_of_client[client_of]
    steps = max(1, len(labels) // (clusters * batch))
    samplers = []
    for k in range(clusters):
        idx = torch.nonzero(cluster_of_sample == k).flatten()
        if len(idx) == 0:
            raise DtkError(f"strategy.clusters: got {clusters}; cluster {k} holds no data with "
                           f"strategy.clients={clients}, strategy.alpha={alpha:g}; accepted: fewer clusters or "
                           f"more clients")
        samplers.append(GlobalSampler(idx, batch=batch, steps_per_epoch=steps, seed=seed, cluster=k))
    return Federation(client_of=client_of, cluster_of_client=cluster_of_client, samplers=samplers,
                      global_epoch_steps=steps)
