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

    # A data set with a validation split also has val_batch(*, index, size): held-out batch `index`, the same
    # batches at every evaluation (dtk.evaluation draws index = batch * world + rank).


def has_validation(dataset) -> bool:
    return callable(getattr(dataset, "val_batch", None))


def batch_generator(seed: int, step: int, rank: int, micro: int) -> torch.Generator:
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 4099 + rank) * 131 + micro)


def build_dataset(cfg, *, seed: int, world: int = 1, grad_accum: int = 1) -> Dataset:
    """`world` and `grad_accum` place a rank's micro-batch in the run's order of samples (tokens: no window is drawn
    twice in an epoch); the others draw each batch from (seed, step, rank, micro) alone."""
    from dtk.data.cifar10 import Cifar10
    from dtk.data.digits import Digits
    from dtk.data.synthetic import SyntheticTokens
    from dtk.data.target import build_target
    from dtk.data.text import CharText
    from dtk.data.tokens import TokenFile

    if cfg.target:
        return build_target(cfg.target, seed=seed, kwargs=cfg.kwargs)
    # tokens: the context comes from meta.json unless the recipe sets data.seq_len
    seq_len = cfg.seq_len if "seq_len" in cfg.model_fields_set else None
    builders: dict[str, Callable] = {
        "synthetic": lambda: SyntheticTokens(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, seed=seed),
        "digits": lambda: Digits(seed=seed, held_out=cfg.held_out),
        "cifar10": lambda: Cifar10(path=cfg.path, seed=seed),
        "text": lambda: CharText(path=cfg.path, seq_len=cfg.seq_len, seed=seed, held_out=cfg.held_out),
        "tokens": lambda: TokenFile(path=cfg.path, seq_len=seq_len, seed=seed, world=world, grad_accum=grad_accum),
    }
    return builders[cfg.name]()


DATASETS = {
    "synthetic": "synthetic tokens from a fixed random Markov chain (learnable; deterministic by seed)",
    "digits": "scikit-learn's bundled load_digits: 1,797 8x8 images, 10 classes",
    "text": "a char-level text file you point to with data.path",
    "cifar10": "CIFAR-10 from a local folder of its binary batches (data.path); 32x32 color images, 10 classes",
    "tokens": "memory-mapped token files `dtk data prepare` wrote (data.path: the folder); any tokenizer",
}
