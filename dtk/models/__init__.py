"""Model registry: built-in models by name, a user's `package.module:function`, or a transformers model (model.hf)."""
from __future__ import annotations

from typing import Callable, Iterable, Protocol, cast

import torch
from torch import nn

from dtk.data.spec import DataSpec
from dtk.errors import DtkError
from dtk.models.cnn import build_cnn
from dtk.models.gpt import build_gpt
from dtk.models.init import Blueprint
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


def model_blueprint(cfg, spec: DataSpec, *, seed: int) -> Blueprint | None:
    """How to build the model on meta and fill it with the seed's values (dtk.models.init), or None for a user
    target, whose constructor may initialise its weights in ways only a full build reproduces, and for a
    model.hf.path whose weights are not in safetensors files (they cannot be read by slices)."""
    weights = None
    if cfg.hf is not None:
        from dtk.models.hf import hf_constructor, pretrained_weights  # transformers is an optional extra

        if cfg.hf.path is not None:
            weights = pretrained_weights(cfg.hf)
            if weights is None:
                return None  # weights that cannot be read by slices (pytorch_model.bin): a full build
        construct = hf_constructor(cfg.hf, spec)
    elif cfg.target:
        return None
    else:
        build, _ = MODELS[cfg.name]

        def construct() -> nn.Module:
            return build(cfg, spec)
    return Blueprint(construct=construct, seed=seed, units=_init_groups, weights=weights or None)


def _init_groups(model: nn.Module) -> list[str]:
    """The groups a model is filled by (dtk.models.init): its default wrap units, whatever strategy.wrap says,
    so that the values never depend on the strategy."""
    try:
        return find_wrap_units(model).names
    except DtkError:  # units that split a tie: fill the model as one group
        return []


def build_model(cfg, spec: DataSpec, *, seed: int) -> nn.Module:
    """The whole model on CPU. The same seed gives the same weights on every rank and under every strategy,
    sharded ones included (they fill their shards from the same blueprint)."""
    blueprint = model_blueprint(cfg, spec, seed=seed)
    if blueprint is not None:
        return blueprint.full()
    torch.manual_seed(seed)
    if cfg.hf is not None:
        from dtk.models.hf import build_hf

        return build_hf(cfg.hf, spec)
    return import_target("model.target", cfg.target)(spec, **cfg.kwargs)


def shard_units(model: nn.Module, *, names: list[str] | tuple[str, ...] = ()) -> WrapUnits:
    """The submodules FSDP wraps one by one (see dtk.models.wrap); the root is wrapped last."""
    return find_wrap_units(model, names=names)


class _Chain(Protocol):
    def layers_in_order(self) -> Iterable[nn.Module]: ...


def layers_in_order(model: nn.Module) -> list[nn.Module]:
    """The model as a chain of modules whose composition is its forward: where split learning may cut it.
    A model offers it as `layers_in_order()`, or is an nn.Sequential."""
    if hasattr(model, "layers_in_order"):
        # hasattr does not narrow nn.Module, whose __getattr__ types every undeclared attribute as Tensor | Module
        return list(cast(_Chain, model).layers_in_order())
    if isinstance(model, nn.Sequential):
        return list(model)
    raise DtkError(f"model: {type(model).__name__} cannot be cut into a chain of layers; accepted: model.name cnn, "
                   f"mlp or resnet, or a model.target that returns an nn.Sequential")
