"""A char-level text file: the vocabulary is the file's sorted characters; samples are random windows."""
from __future__ import annotations

from pathlib import Path

import torch

from dtk.data.spec import DataSpec, batch_generator
from dtk.errors import DtkError


class CharText:
    def __init__(self, *, path: str, seq_len: int, seed: int):
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        if len(text) <= seq_len + 1:
            raise DtkError(f"data.path: {path!r} holds {len(text)} characters; needs more than data.seq_len + 1 ({seq_len + 1})")
        chars = sorted(set(text))
        index = {c: i for i, c in enumerate(chars)}
        self.tokens = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.spec = DataSpec(kind="tokens", vocab_size=len(chars), seq_len=seq_len, classes=len(chars))
        self.seed = seed

    def batch(self, *, step: int, rank: int, micro: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.spec.seq_len
        starts = torch.randint(0, len(self.tokens) - n - 1, (size,), generator=batch_generator(self.seed, step, rank, micro))
        window = torch.stack([self.tokens[s:s + n + 1] for s in starts.tolist()])
        return window[:, :-1], window[:, 1:]
