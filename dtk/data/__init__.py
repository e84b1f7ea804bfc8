"""Data registry. Every data set samples deterministically from (seed, step, rank, micro-step), so a resumed
or recovered run sees exactly the batches it would have seen."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

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


def batch_generator(seed: int, step: int, rank: int, micro: int) -> torch.Generator:
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 4099 + rank) * 131 + micro)


def build_dataset(cfg, *, seed: int) -> Dataset:
    from dtk.data.cifar10 import Cifar10
    from dtk.data.digits import Digits
    from dtk.data.synthetic import SyntheticTokens
    from dtk.data.text import CharText

    builders: dict[str, Callable] = {
        "synthetic": lambda: SyntheticTokens(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, seed=seed),
        "digits": lambda: Digits(seed=seed, held_out=cfg.held_out),
        "cifar10": lambda: Cifar10(path=cfg.path, seed=seed),
        "text": lambda: CharText(path=cfg.path, seq_len=cfg.seq_len, seed=seed),
    }
    return builders[cfg.name]()


DATASETS = {
    "synthetic": "synthetic tokens from a fixed random Markov chain (learnable; deterministic by seed)",
    "digits": "scikit-learn's bundled load_digits: 1,797 8x8 images, 10 classes",
    "text": "a char-level text file you point to with data.path",
    "cifar10": "CIFAR-10 from a local folder of its binary batches (data.path); 32x32 color images, 10 classes",
}
