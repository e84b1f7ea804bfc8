"""Token files that `dtk data prepare` wrote (train.bin, val.bin: flat arrays as np.memmap reads them; meta.json):
windows of seq_len + 1 tokens, drawn without replacement within an epoch, by (seed, step, rank, micro) so a resumed
run sees the same.

Epoch e visits the train windows in the order of a pseudo-random permutation drawn from (seed, e): a 4-round Feistel
network on the next even power of two, cycle-walked into range. It is computed per index, so a rank holds no
permutation table; a window is read by one positioned read of its bytes, so the file itself never counts against
the rank's resident memory (only the OS page cache holds it), whatever its size.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from dtk.data import DataSpec
from dtk.errors import DtkError

_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a cheap, well-spread 64-bit hash (wrapping uint64 arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _C1
    x = (x ^ (x >> np.uint64(27))) * _C2
    return x ^ (x >> np.uint64(31))


class WindowOrder:
    """A permutation of range(n) drawn from (seed, epoch); `order(i)` is the i-th window visited."""

    def __init__(self, n: int, *, seed: int, epoch: int, rounds: int = 4):
        bits = max(2, (n - 1).bit_length())
        bits += bits & 1
        self.n, self.half, self.mask = n, np.uint64(bits // 2), np.uint64((1 << (bits // 2)) - 1)
        base = (seed * 1_000_003 + epoch) * 131
        self.keys = [_mix(np.array([base + r], dtype=np.uint64))[0] for r in range(rounds)]

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, index: np.ndarray) -> np.ndarray:
        y = self._round_trip(index.astype(np.uint64))
        while (out := y >= self.n).any():  # cycle-walking: a bijection of [0, 2^bits) restricted to [0, n)
            y[out] = self._round_trip(y[out])
        return y.astype(np.int64)


def read_meta(path: str | Path) -> dict:
    """meta.json of a prepared folder, its token files checked against it; a user error names data.path."""
    root = Path(path)
    meta_path = root / "meta.json"
    if not meta_path.is_file():
        raise DtkError(f"data.path: got {str(path)!r}; no meta.json in it; accepted: a folder `dtk data prepare` "
                       f"wrote (train.bin, val.bin, meta.json)")
    try:
        meta = json.loads(meta_path.read_text())
        item = np.dtype(meta["dtype"]).itemsize
        counts = {"train": int(meta["train_tokens"]), "val": int(meta["val_tokens"])}
        int(meta["vocab_size"]), int(meta["seq_len"])
    except (ValueError, KeyError, TypeError) as e:
        raise DtkError(f"data.path: {str(meta_path)!r} is not a dtk meta.json ({type(e).__name__}: {e}); accepted: "
                       f"a folder `dtk data prepare` wrote") from None
    for split, n in counts.items():
        f = root / f"{split}.bin"
        size = f.stat().st_size if f.is_file() else None
        if size != n * item:
            got = "is missing" if size is None else f"holds {size} bytes"
            raise DtkError(f"data.path: {str(f)!r} {got}; meta.json says {n} {meta['dtype']} tokens ({n * item} "
                           f"bytes); accepted: the files as `dtk data prepare` wrote them (prepare again)")
    return meta


class TokenFile:
    def __init__(self, *, path: str, seq_len: int | None, seed: int, world: int = 1, grad_accum: int = 1):
        self.root, self.meta = Path(path), read_meta(path)
        n = seq_len or int(self.meta["seq_len"])
        self.dtype = np.dtype(self.meta["dtype"])
        self.windows = (int(self.meta["train_tokens"]) - 1) // n
        self.val_windows = (int(self.meta["val_tokens"]) - 1) // n
        if self.windows < 1 or self.val_windows < 1:
            short = "train" if self.windows < 1 else "val"
            raise DtkError(f"data.seq_len: got {n}; {short}.bin holds {self.meta[short + '_tokens']} tokens, fewer than "
                           f"data.seq_len + 1; accepted: a shorter data.seq_len")
        vocab = int(self.meta["vocab_size"])
        self.spec = DataSpec(kind="tokens", vocab_size=vocab, seq_len=n, classes=vocab)
        self.seed, self.world, self.grad_accum = seed, world, grad_accum
        self._orders: dict[int, WindowOrder] = {}

    def _order(self, epoch: int) -> WindowOrder:
        if epoch not in self._orders:
            self._orders = {epoch: WindowOrder(self.windows, seed=self.seed, epoch=epoch)}
        return self._orders[epoch]

    def train_windows(self, *, step: int, rank: int, micro: int, size: int) -> np.ndarray:
        """The window indices of one micro-batch: consecutive positions in the run's global order of samples
        (step, then micro-step, then rank), so the ranks of a step never draw the same window within an epoch."""
        first = (step * self.grad_accum * self.world + micro * self.world + rank) * size
        pos = np.arange(first, first + size, dtype=np.int64)
        epoch, within = np.divmod(pos, self.windows)
        out = np.empty(size, dtype=np.int64)
        for e in np.unique(epoch):
            sel = epoch == e
            out[sel] = self._order(int(e))(within[sel])
        return out

    def _read(self, split: str, windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        n, item = self.spec.seq_len, self.dtype.itemsize
        # Positioned reads, not a mapping: faulting a mapped file brings in whole page-cache folios, which raised a
        # rank's peak RSS by ~35 MB per 16-window batch on a 1 GB file (12 MB on a 10 MB one); pread copies only
        # the window's bytes (3 MB for both; BENCHMARKS.md).
        fd = os.open(self.root / f"{split}.bin", os.O_RDONLY)
        try:
            rows = np.stack([np.frombuffer(os.pread(fd, (n + 1) * item, w * n * item), dtype=self.dtype)
                             for w in windows.tolist()]).astype(np.int64)
        finally:
            os.close(fd)
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]

    def batch(self, *, step: int, rank: int, micro: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._read("train", self.train_windows(step=step, rank=rank, micro=micro, size=size))

    def val_batch(self, *, index: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out batch `index`: val.bin's windows in file order, from the start again when they run out."""
        return self._read("val", (np.arange(index * size, (index + 1) * size) % self.val_windows))

    def epochs(self, *, steps: int, samples_per_step: int) -> float:
        return steps * samples_per_step / self.windows
