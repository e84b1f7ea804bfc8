"""A small ResNet for little images: a 3x3 stem, one basic residual block per stage (channels double and the
image halves after the first), global pooling, a linear head. BatchNorm as in ResNet; split learning swaps it."""
from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.norm2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(self.norm2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Sequential):
    """Sequential on purpose: its children in order are the places where split learning can cut it."""

    def __init__(self, *, channels: int, classes: int, layers: int, width: int):
        stem = nn.Sequential(nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        dims = [width * 2 ** i for i in range(layers)]
        blocks = [BasicBlock(dims[max(i - 1, 0)], d, 1 if i == 0 else 2) for i, d in enumerate(dims)]
        head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(dims[-1], classes))
        super().__init__(stem, *blocks, head)


def build_resnet(cfg, spec) -> ResNet:
    return ResNet(channels=spec.input_shape[0], classes=spec.classes, layers=cfg.layers, width=cfg.width)
