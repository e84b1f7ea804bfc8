"""An MLP of residual blocks over flattened inputs (blocks let FSDP shard it unit by unit)."""
from __future__ import annotations

import math

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class MLP(nn.Module):
    def __init__(self, *, in_features: int, classes: int, layers: int, width: int):
        super().__init__()
        self.inp = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(layers)])
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.inp(x.flatten(1)))
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def layers_in_order(self) -> list[nn.Module]:
        return [nn.Sequential(nn.Flatten(), self.inp, nn.ReLU()), *self.blocks, self.head]


def build_mlp(cfg, spec) -> MLP:
    return MLP(in_features=math.prod(spec.input_shape), classes=spec.classes, layers=cfg.layers, width=cfg.width)
