"""scikit-learn's bundled 8x8 digits (no download), scaled to [0, 1], as 1x8x8 images; optionally a held-out share."""
from __future__ import annotations

import torch

from dtk.data import DataSpec, batch_generator


class Digits:
    def __init__(self, *, seed: int, held_out: float = 0.0):
        from sklearn.datasets import load_digits

        d = load_digits()
        self.images = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
        self.labels = torch.tensor(d.target, dtype=torch.long)
        self.spec = DataSpec(kind="images", input_shape=(1, 8, 8), classes=10)
        self.seed = seed
        # the split depends on the seed only, so every strategy trains and tests on the same samples
        order = torch.randperm(len(self.labels), generator=torch.Generator().manual_seed(seed + 7919))
        n_test = int(round(held_out * len(self.labels)))
        train = torch.sort(order[n_test:]).values if n_test else torch.arange(len(self.labels))
        test = torch.sort(order[:n_test]).values
        self.train_images, self.train_labels = self.images[train], self.labels[train]
        self.test_images, self.test_labels = self.images[test], self.labels[test]
        if not n_test:
            self.val_batch = None  # type: ignore[assignment]  (no held-out split: has_validation() is False)

    def batch(self, *, step: int, rank: int, micro: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = batch_generator(self.seed, step, rank, micro)
        idx = torch.randint(0, len(self.train_labels), (size,), generator=g)
        return self.train_images[idx], self.train_labels[idx]

    def val_batch(self, *, index: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.arange(index * size, (index + 1) * size) % len(self.test_labels)
        return self.test_images[idx], self.test_labels[idx]
