"""Synthetic tokens: each token follows its predecessor through a fixed random permutation 80% of the time,
so a model can learn it and the loss falls; the chain is fixed by the seed."""
from __future__ import annotations

import torch

from dtk.data.spec import DataSpec, batch_generator


class SyntheticTokens:
    def __init__(self, *, vocab_size: int, seq_len: int, seed: int):
        self.spec = DataSpec(kind="tokens", vocab_size=vocab_size, seq_len=seq_len, classes=vocab_size)
        self.seed = seed
        self.successor = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))

    def batch(self, *, step: int, rank: int, micro: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = batch_generator(self.seed, step, rank, micro)
        n, v = self.spec.seq_len + 1, self.spec.vocab_size
        noise = torch.randint(0, v, (size, n), generator=g)
        follow = torch.rand(size, n, generator=g) < 0.8
        seq = torch.empty(size, n, dtype=torch.long)
        seq[:, 0] = noise[:, 0]
        for t in range(1, n):
            seq[:, t] = torch.where(follow[:, t], self.successor[seq[:, t - 1]], noise[:, t])
        return seq[:, :-1], seq[:, 1:]
