"""Model registry: built-in models by name, a user's `package.module:function`, or a transformers model (model.hf)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dtk.data import DataSpec
from dtk.errors import DtkError
from dtk.models.cnn import build_cnn
from dtk.models.gpt import build_gpt
from dtk.models.mlp import build_mlp
from dtk.models.wrap import WrapUnits, find_wrap_units
from dtk.targets import import_target
from dtk.models.resnet import build_resnet

MODELS: dict[str, tuple[Callable, str]] = {
    "gpt": (build_gpt, "tiny GPT (causal self-attention); layers, width, heads; reads tokens"),
    "mlp": (build_mlp, "multilayer perceptron with residual blocks; reads images as flat vectors"),
    "cnn": (build_cnn, "small convolutional network; reads images"),
    "resnet": (build_resnet, "small ResNet: stem, one residual block per stage (layers), BatchNorm; reads images"),
}


def build_model(cfg, spec: DataSpec, *, seed: int) -> nn.Module:
    """The same seed gives the same weights on every rank and under every strategy."""
    torch.manual_seed(seed)
    if cfg.hf is not None:
        from dtk.models.hf import build_hf  # transformers is an optional extra

        return build_hf(cfg.hf, spec)
    if cfg.target:
        return import_target("model.target", cfg.target)(spec, **cfg.kwargs)
    build, _ = MODELS[cfg.name]
    return build(cfg, spec)


def shard_units(model: nn.Module, *, names: list[str] | tuple[str, ...] = ()) -> WrapUnits:
    """The submodules FSDP wraps one by one (see dtk.models.wrap); the root is wrapped last."""
    return find_wrap_units(model, names=names)


def layers_in_order(model: nn.Module) -> list[nn.Module]:
    """The model as a chain of modules whose composition is its forward: where split learning may cut it.
    A model offers it as `layers_in_order()`, or is an nn.Sequential."""
    if hasattr(model, "layers_in_order"):
        return list(model.layers_in_order())
    if isinstance(model, nn.Sequential):
        return list(model)
    raise DtkError(f"model: {type(model).__name__} cannot be cut into a chain of layers; accepted: model.name cnn, "
                   f"mlp or resnet, or a model.target that returns an nn.Sequential")
