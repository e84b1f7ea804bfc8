"""What a data set is: its shape (`DataSpec`), the `Dataset` protocol every data set meets, and the one seeded
generator that makes every batch a function of (seed, step, rank, micro-step)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeGuard

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSpec:
    kind: str  # "tokens" or "images"
    vocab_size: int = 0
    seq_len: int = 0
    input_shape: tuple[int, ...] = ()
    classes: int = 0
    """Targets per sample: next tokens (tokens) or one class (images)."""


class Dataset(Protocol):
    spec: DataSpec

    def batch(self, *, step: int, rank: int, micro: int, size: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    # A data set with a validation split also has val_batch(*, index, size): held-out batch `index`, the same
    # batches at every evaluation (dtk.evaluation draws index = batch * world + rank).


class ValidatedDataset(Dataset, Protocol):
    """A data set with a validation split."""

    def val_batch(self, *, index: int, size: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def has_validation(dataset) -> TypeGuard[ValidatedDataset]:
    return callable(getattr(dataset, "val_batch", None))


def batch_generator(seed: int, step: int, rank: int, micro: int) -> torch.Generator:
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 4099 + rank) * 131 + micro)
