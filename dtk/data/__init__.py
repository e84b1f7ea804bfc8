"""Data registry. Every data set samples deterministically from (seed, step, rank, micro-step), so a resumed
or recovered run sees exactly the batches it would have seen."""
from __future__ import annotations

from typing import Callable

from dtk.data.cifar10 import Cifar10
from dtk.data.digits import Digits
from dtk.data.spec import Dataset, DataSpec, batch_generator
from dtk.data.synthetic import SyntheticTokens
from dtk.data.text import CharText

__all__ = ["DATASETS", "DataSpec", "Dataset", "batch_generator", "build_dataset"]


def build_dataset(cfg, *, seed: int) -> Dataset:
    builders: dict[str, Callable[[], Dataset]] = {
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
