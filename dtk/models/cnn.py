"""A small CNN for little images (digits are 1x8x8): conv blocks, global pooling, linear head."""
from __future__ import annotations

import torch
from torch import nn


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm = nn.GroupNorm(1, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(x)))


class CNN(nn.Module):
    def __init__(self, *, channels: int, classes: int, layers: int, width: int):
        super().__init__()
        dims = [channels] + [width] * layers
        self.blocks = nn.ModuleList([ConvBlock(a, b) for a, b in zip(dims, dims[1:])])
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))

    def layers_in_order(self) -> list[nn.Module]:
        return [*self.blocks, nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), self.head)]


def build_cnn(cfg, spec) -> CNN:
    return CNN(channels=spec.input_shape[0], classes=spec.classes, layers=cfg.layers, width=cfg.width)
