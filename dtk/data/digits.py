"""scikit-learn's bundled 8x8 digits (no download), scaled to [0, 1], as 1x8x8 images."""
from __future__ import annotations

import torch

from dtk.data import DataSpec, batch_generator


class Digits:
    def __init__(self, *, seed: int):
        from sklearn.datasets import load_digits

        d = load_digits()
        self.images = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
        self.labels = torch.tensor(d.target, dtype=torch.long)
        self.spec = DataSpec(kind="images", input_shape=(1, 8, 8), classes=10)
        self.seed = seed

    def batch(self, *, step: int, rank: int, micro: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(self.labels), (size,), generator=batch_generator(self.seed, step, rank, micro))
        return self.images[idx], self.labels[idx]
