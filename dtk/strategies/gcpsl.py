"""GCPSL (global clustered parallel split learning): the clients are grouped into fixed clusters, each cluster runs
one GPSL workload (a client segment shared by its clients, a server segment, a global sampler per epoch), and every
P steps the segments of all clusters are averaged, weighted by the clusters' data sizes.

`gcpsl` runs one cluster per rank and averages through the seam (an all-reduce on the group it is given);
`gcpsl_serial` runs every cluster on one rank, one after another, and averages in place: the baseline.
The engine draws its own batches (the global sampler over its cluster's clients): the trainer's batch is only the
signal to run a step. Held-out accuracy, direct participation and time to target accuracy come out of `metrics()`.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector

from dtk.data import build_dataset
from dtk.data.clients import build_federation
from dtk.errors import DtkError
from dtk.models import layers_in_order
from dtk.strategies.base import (BuildContext, autocast, build_torch_optimizer, load_torch_checkpoint_state, loss_fn,
                                 materialize_optimizer_state, optimizer_tensors, torch_checkpoint_state)

log = logging.getLogger(__name__)
EVAL_CHUNK = 1000


@runtime_checkable
class _ImageSplits(Protocol):
    """The image data sets (digits, cifar10) hold their train and test splits whole: gcpsl samples them itself."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor


def copy_into(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Write a flat vector into the parameters' own storage (torch's vector_to_parameters would make them views of
    one shared vector, and the clusters of gcpsl_serial would then train one tensor)."""
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def batch_norm_to_group_norm(module: nn.Module) -> nn.Module:
    """GPSL replaces BatchNorm by GroupNorm: a batch mixes many clients' samples, and per-sample statistics keep a
    client's result independent of who else is in the batch (and leave no running buffers to merge)."""
    for name, child in module.named_children():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            setattr(module, name, nn.GroupNorm(math.gcd(child.num_features, 8), child.num_features))
        else:
            batch_norm_to_group_norm(child)
    return module


class Workload:
    """One cluster's GPSL workload: the client segment (shared by the cluster's clients), the server segment, and
    their optimizer. A step is split learning's exchange: activations cross the cut, their gradient comes back."""

    def __init__(self, *, model: nn.Module, cut: int, recipe, device: torch.device):
        layers = layers_in_order(batch_norm_to_group_norm(model))
        self.client = nn.Sequential(*layers[:cut]).to(device)
        self.server = nn.Sequential(*layers[cut:]).to(device)
        self.pair = nn.Sequential(self.client, self.server)
        self.params = list(self.pair.parameters())
        self.optimizer = build_torch_optimizer(self.params, recipe.optimizer)
        self.device, self.precision, self.clip = device, recipe.training.precision, recipe.optimizer.grad_clip

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
        # Every client of the batch runs the shared client segment on its own samples; one call on their
        # concatenation gives the same activations and the summed gradient (GroupNorm is per sample).
        with autocast(self.device, self.precision):
            smashed = self.client(x)
        at_cut = smashed.detach().requires_grad_()
        with autocast(self.device, self.precision):
            logits = self.server(at_cut)
        loss = loss_fn(logits, y)
        loss.backward()
        smashed.backward(at_cut.grad)
        return loss.detach(), 2 * smashed.numel() * smashed.element_size()

    def step(self) -> None:
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class GCPSLEngine:
    def __init__(self, ctx: BuildContext, *, serial: bool):
        r, s = ctx.recipe, ctx.recipe.strategy
        self.group, self.device, self.serial = ctx.group, ctx.device, serial
        self.rank, world = ctx.group.rank(), ctx.group.size()
        clusters = s.clusters or (1 if serial else world)
        if clusters != world and not serial:  # the recipe checks world.nproc; this also holds across nodes
            raise DtkError(f"strategy.clusters: got {clusters}; gcpsl runs one cluster per rank and this run has "
                           f"{world} ranks; accepted: {world}")
        data = build_dataset(r.data, seed=r.training.seed)
        assert isinstance(data, _ImageSplits)  # the recipe gives gcpsl image data only
        self.train_x, self.train_y = data.train_images, data.train_labels
        self.test_x, self.test_y = data.test_images, data.test_labels
        self.federation = build_federation(self.train_y, clients=s.clients, clusters=clusters,
                                           assignment=s.assignment, alpha=s.alpha, batch=r.training.micro_batch,
                                           seed=r.training.seed)
        sizes = self.federation.cluster_sizes
        self.weights = {k: n / sum(sizes) for k, n in enumerate(sizes)}
        # every cluster starts from the same weights: the factory seeds them
        self.workloads = {k: Workload(model=ctx.model_factory(), cut=s.cut, recipe=r, device=ctx.device)
                          for k in (range(clusters) if serial else [self.rank])}
        self.module = nn.ModuleList(w.pair for w in self.workloads.values())
        self.samples_per_step = r.training.micro_batch * clusters
        self.merge_every, self.total_steps = s.merge_every, r.training.steps
        self.target = r.training.target_accuracy
        self.step_counter = torch.zeros((), dtype=torch.int64)
        self.reports = self.rank == 0
        self.accuracy: float | None = None
        self.time_to_target_s: float | None = None
        self._started_at: float | None = None
        self._eval_seconds = 0.0
        self._cut_bytes = 0
        self._merged = False
        self._seen = torch.zeros(len(self.train_y), dtype=torch.bool)
        self._seen_epoch = -1
        self._epoch_participation: float | None = None
        if self.reports:
            log.info("gcpsl%s: %d clients, %d clusters (%s), data per cluster %s, merge every %d steps, cut at %d",
                     "_serial" if serial else "", s.clients, clusters, s.assignment, sizes, s.merge_every, s.cut)

    @property
    def step(self) -> int:
        return int(self.step_counter)

    # -- the Engine interface --
    def forward_backward(self, x, y, *, last_micro: bool) -> torch.Tensor:
        """x and y (the trainer's batch) only say "run a step": each cluster draws from its own global sampler."""
        if self._started_at is None:
            self._started_at = time.perf_counter()
        losses, self._cut_bytes = [], 0
        for k, w in self.workloads.items():
            idx = self.federation.samplers[k].draw(self.step)
            loss, cut_bytes = w.forward_backward(self.train_x[idx].to(self.device), self.train_y[idx].to(self.device))
            losses.append(loss)
            self._cut_bytes += cut_bytes
        return torch.stack(losses).float().mean()

    def optimizer_step(self) -> None:
        for w in self.workloads.values():
            w.step()
        self.step_counter += 1
        self._merged = self.step % self.merge_every == 0 or self.step == self.total_steps
        if self._merged:
            self.merge()
        if self.reports:
            self._note_participation(self.step - 1)
            if self._merged:
                self._evaluate()

    def discard_step(self) -> None:
        for w in self.workloads.values():
            w.optimizer.zero_grad(set_to_none=True)

    def param_groups(self) -> list[dict]:
        return [g for w in self.workloads.values() for g in w.optimizer.param_groups]

    def grad_square_share(self) -> float | None:
        return None

    def grad_norm(self) -> float | None:
        return None  # clusters train separate copies: no one global gradient

    def local_state(self) -> list[torch.Tensor]:
        out = []
        for w in self.workloads.values():
            materialize_optimizer_state(w.optimizer)
            out += [p.data for p in w.params] + optimizer_tensors(w.optimizer, w.params)
        return out + [self.step_counter]

    def match_running_layout(self, x, y) -> None:
        pass  # its only collective is the merge's all-reduce, the same on every rank from the first step

    def checkpoint_state(self) -> dict:
        # keys name the cluster, so each rank saves and loads only its own
        return {"clusters": {str(k): torch_checkpoint_state(w.pair, w.optimizer) for k, w in self.workloads.items()},
                "step": self.step_counter.clone()}

    def after_checkpoint_load(self, state: dict) -> None:
        for k, w in self.workloads.items():
            load_torch_checkpoint_state(w.pair, w.optimizer, state["clusters"][str(k)])
        self.step_counter.fill_(int(state["step"]))

    # -- GCPSL --
    def merge(self) -> None:
        """Every cluster's segments become the data-size weighted average of all clusters' segments."""
        if self.serial:
            total = None
            for k, w in self.workloads.items():
                part = parameters_to_vector(w.params) * self.weights[k]
                total = part if total is None else total + part
            assert total is not None  # there is a workload per cluster, at least one
            for w in self.workloads.values():
                copy_into(w.params, total)
            return
        (k, w), = self.workloads.items()
        flat = parameters_to_vector(w.params) * self.weights[k]
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)  # through the seam: counted, watched
        copy_into(w.params, flat)

    @torch.no_grad()
    def _evaluate(self) -> None:
        """Held-out accuracy of the merged model (every cluster holds it); its time is left out of the clock."""
        t0 = time.perf_counter()
        pair = next(iter(self.workloads.values())).pair
        pair.eval()
        correct = 0
        for i in range(0, len(self.test_y), EVAL_CHUNK):
            x = self.test_x[i:i + EVAL_CHUNK].to(self.device)
            with autocast(self.device, next(iter(self.workloads.values())).precision):
                correct += int((pair(x).argmax(-1).cpu() == self.test_y[i:i + EVAL_CHUNK]).sum())
        pair.train()
        self.accuracy = correct / max(len(self.test_y), 1)
        assert self._started_at is not None  # set by the step's forward_backward
        trained = t0 - self._started_at - self._eval_seconds
        self._eval_seconds += time.perf_counter() - t0
        if self.target is not None and self.time_to_target_s is None and self.accuracy >= self.target:
            self.time_to_target_s = trained
            log.info("target accuracy %.3f reached at step %d: %.3f after %.2fs of training", self.target, self.step,
                     self.accuracy, trained)

    def _note_participation(self, step: int) -> None:
        """Mark the samples every cluster drew at `step` in its global epoch (replayed after a resume)."""
        per_epoch = self.federation.global_epoch_steps
        epoch = step // per_epoch
        if epoch != self._seen_epoch:
            self._seen.zero_()
            self._seen_epoch = epoch
            for earlier in range(epoch * per_epoch, step):
                self._mark(earlier)
        self._mark(step)
        self._epoch_participation = self.participation() if (step + 1) % per_epoch == 0 else None

    def _mark(self, step: int) -> None:
        for sampler in self.federation.samplers:
            self._seen[sampler.draw(step)] = True

    def participation(self) -> float:
        """Direct data participation: the share of training samples drawn at least once in this global epoch."""
        return float(self._seen.float().mean())

    def client_participation(self) -> float:
        """The share of clients holding data whose data was drawn at least once in this global epoch."""
        holding = torch.unique(self.federation.client_of)
        return len(torch.unique(self.federation.client_of[self._seen])) / len(holding)

    def metrics(self) -> dict:
        """Extra fields of this step's record (rank 0 writes them)."""
        if not self.reports:
            return {}
        return {"accuracy": self.accuracy, "merged": self._merged, "participation": self.participation(),
                "client_participation": self.client_participation(),
                "epoch_participation": self._epoch_participation, "time_to_target_s": self.time_to_target_s,
                "cut_bytes": self._cut_bytes}


def build(ctx: BuildContext, *, serial: bool) -> GCPSLEngine:
    return GCPSLEngine(ctx, serial=serial)
