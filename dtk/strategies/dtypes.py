"""What dtypes an engine really trains in, seen in its first forward rather than read from the recipe: the weights
a layer multiplies with, the activations it gives, and the copy of the parameters the optimizer updates
(summary.json -> dtypes)."""
from __future__ import annotations

import torch
from torch import nn

from dtk.strategies.memory import updated_tensors


def _first_layer(module: nn.Module) -> nn.Module | None:
    """The first module with a matrix (or kernel) of weights that is not an embedding table: a Linear, a Conv,
    transformers' Conv1D. ZeRO-3 leaves a partitioned parameter empty between uses; its ds_shape is the real one."""
    for m in module.modules():
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor) and not isinstance(m, nn.Embedding) and len(getattr(w, "ds_shape", w.shape)) >= 2:
            return m
    return None


class DtypeProbe:
    """One-shot hooks on an engine's first weight layer; `seen()` is None until a forward ran through it."""

    def __init__(self, engine):
        self.engine, self._seen = engine, {}
        self._hooks = []
        layer = _first_layer(engine.module)
        if layer is not None:
            # a pre-hook: the strategy's own pre-forward hooks (FSDP's unshard, ZeRO-3's gather) ran before it, so
            # the weight is the one the forward computes with
            self._hooks = [layer.register_forward_pre_hook(self._weights), layer.register_forward_hook(self._output)]

    def _weights(self, layer, args) -> None:
        self._seen.setdefault("weights", str(layer.weight.dtype).removeprefix("torch."))

    def _output(self, layer, args, output) -> None:
        if isinstance(output, torch.Tensor):
            self._seen.setdefault("activations", str(output.dtype).removeprefix("torch."))
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def seen(self) -> dict | None:
        """{"weights", "activations", "master"}: dtype names (float32, bfloat16); master is what the optimizer
        updates (None for an engine without one optimizer)."""
        if "weights" not in self._seen:
            return None
        updated = updated_tensors(self.engine)
        master = str(updated[0].dtype).removeprefix("torch.") if updated else None
        return {**self._seen, "master": master}
