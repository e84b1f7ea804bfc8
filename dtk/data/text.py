"""A char-level text file: the vocabulary is the file's sorted characters; samples are random windows; optionally
the file's last share (data.held_out) is kept out of training, for evaluation."""
from __future__ import annotations

from pathlib import Path

import torch

from dtk.data import DataSpec, batch_generator
from dtk.errors import DtkError


class CharText:
    def __init__(self, *, path: str, seq_len: int, seed: int, held_out: float = 0.0):
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        if len(text) <= seq_len + 1:
            raise DtkError(f"data.path: {path!r} holds {len(text)} characters; needs more than data.seq_len + 1 ({seq_len + 1})")
        chars = sorted(set(text))
        index = {c: i for i, c in enumerate(chars)}
        tokens = torch.tensor([index[c] for c in text], dtype=torch.long)
        n_val = int(round(held_out * len(tokens)))
        if held_out and (n_val <= seq_len + 1 or len(tokens) - n_val <= seq_len + 1):
            raise DtkError(f"data.held_out: got {held_out:g}; {path!r} would hold {n_val} held-out and "
                           f"{len(tokens) - n_val} training characters; each needs more than data.seq_len + 1 "
                           f"({seq_len + 1}); accepted: a share that leaves both")
        self.tokens, self.val_tokens = tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]
        self.spec = DataSpec(kind="tokens", vocab_size=len(chars), seq_len=seq_len, classes=len(chars))
        self.seed = seed
        if not n_val:
            self.val_batch = None  # type: ignore[assignment]  (no validation split: has_validation() is False)

    def batch(self, *, step: int, rank: int, micro: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.spec.seq_len
        starts = torch.randint(0, len(self.tokens) - n - 1, (size,), generator=batch_generator(self.seed, step, rank, micro))
        window = torch.stack([self.tokens[s:s + n + 1] for s in starts.tolist()])
        return window[:, :-1], window[:, 1:]

    def val_batch(self, *, index: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The held-out tail's windows in order, from its start again when they run out."""
        n = self.spec.seq_len
        count = (len(self.val_tokens) - 1) // n
        window = torch.stack([self.val_tokens[(w % count) * n:(w % count) * n + n + 1]
                              for w in range(index * size, (index + 1) * size)])
        return window[:, :-1], window[:, 1:]
