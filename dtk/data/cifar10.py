"""CIFAR-10 from a local folder in its standard binary format (data_batch_*.bin, test_batch.bin; each record is
one label byte then 3,072 bytes of 32x32 red, green, blue planes); nothing is downloaded."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from dtk.data import DataSpec, batch_generator
from dtk.errors import DtkError

RECORD = 1 + 3 * 32 * 32
# per-channel mean and std of the CIFAR-10 training images, the usual normalization
MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)


def read_batches(paths: list[Path]) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (N, 3, 32, 32) as uint8 and labels (N,) from binary batch files, in file order."""
    chunks = []
    for p in paths:
        raw = np.fromfile(p, dtype=np.uint8)
        if raw.size % RECORD:
            raise DtkError(f"data.path: {str(p)!r} holds {raw.size} bytes, not a whole number of "
                           f"{RECORD}-byte CIFAR-10 records; accepted: the binary version (cifar-10-batches-bin)")
        chunks.append(raw.reshape(-1, RECORD))
    rows = np.concatenate(chunks) if chunks else np.zeros((0, RECORD), np.uint8)
    labels = torch.from_numpy(rows[:, 0].astype(np.int64))
    images = torch.from_numpy(rows[:, 1:].copy()).view(-1, 3, 32, 32)
    return images, labels


@functools.lru_cache(maxsize=2)
def _load(folder: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    root = Path(folder)
    train = sorted(root.glob("data_batch_*.bin"))
    test = root / "test_batch.bin"
    if not train or not test.is_file():
        raise DtkError(f"data.path: got {folder!r}; it holds no data_batch_*.bin and test_batch.bin; accepted: a "
                       f"folder of CIFAR-10's binary version (cifar-10-batches-bin)")
    x, y = read_batches(train)
    tx, ty = read_batches([test])
    if int(torch.cat([y, ty]).max()) > 9:
        raise DtkError(f"data.path: {folder!r} holds labels above 9; accepted: CIFAR-10 (10 classes)")
    return (x.float() / 255 - MEAN) / STD, y, (tx.float() / 255 - MEAN) / STD, ty


class Cifar10:
    def __init__(self, *, path: str, seed: int):
        self.train_images, self.train_labels, self.test_images, self.test_labels = _load(str(path))
        self.spec = DataSpec(kind="images", input_shape=(3, 32, 32), classes=10)
        self.seed = seed

    def batch(self, *, step: int, rank: int, micro: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = batch_generator(self.seed, step, rank, micro)
        idx = torch.randint(0, len(self.train_labels), (size,), generator=g)
        return self.train_images[idx], self.train_labels[idx]

    def val_batch(self, *, index: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """test_batch.bin's images in file order."""
        idx = torch.arange(index * size, (index + 1) * size) % len(self.test_labels)
        return self.test_images[idx], self.test_labels[idx]
