"""The optimizer's parameter groups: weight decay on weight matrices, none on biases, norms and embeddings.

nanoGPT's and torchtitan's convention: decaying a bias or a norm's gain pulls it toward 0, which it has no reason to
be, and an embedding row is only updated when its token is seen. `optimizer.no_decay` changes the set.
"""
from __future__ import annotations

import fnmatch

from torch import nn

from dtk.errors import DtkError

CATEGORIES = ("bias", "norm", "embedding")


def _is_norm(module: nn.Module) -> bool:
    # transformers' norms (LlamaRMSNorm, ...) are their own classes, not torch's: the name says what they are
    norms = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase, nn.LocalResponseNorm)
    return isinstance(module, norms) or type(module).__name__.endswith("Norm")


def _is_embedding(module: nn.Module) -> bool:
    return isinstance(module, nn.Embedding) or type(module).__name__.endswith("Embedding")


def _categories(module: nn.Module, local_name: str) -> set[str]:
    out = set()
    if local_name == "bias" or local_name.endswith("bias"):
        out.add("bias")
    if _is_norm(module):
        out.add("norm")
    if _is_embedding(module):
        out.add("embedding")
    return out


def split_no_decay(model: nn.Module, no_decay: list[str]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(decayed, not decayed) parameters of `model`, each in the model's parameter order; a tied parameter once."""
    patterns = [p for p in no_decay if p not in CATEGORIES]
    wanted = set(no_decay) & set(CATEGORIES)
    matched: set[str] = set()
    decay: list[nn.Parameter] = []
    keep: list[nn.Parameter] = []
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for local, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            name = f"{module_name}.{local}" if module_name else local
            hits = [pat for pat in patterns if fnmatch.fnmatchcase(name, pat)]
            matched.update(hits)
            (keep if hits or _categories(module, local) & wanted else decay).append(p)
    if unmatched := [p for p in patterns if p not in matched]:
        raise DtkError(f"optimizer.no_decay: got {unmatched[0]!r}; it is no category and matches no parameter name; "
                       f"accepted: {', '.join(CATEGORIES)}, or a glob on names such as "
                       f"{next(iter(n for n, _ in model.named_parameters()), 'layer.weight')!r}")
    order = {id(p): i for i, p in enumerate(model.parameters())}
    return sorted(decay, key=lambda p: order[id(p)]), sorted(keep, key=lambda p: order[id(p)])


def param_groups(model: nn.Module, cfg) -> list[dict]:
    """The optimizer's groups for the optimizer section `cfg`. Without weight decay, one group of every parameter
    (the layout a run had before groups existed, so its losses and its DeepSpeed partitions do not change)."""
    if not cfg.weight_decay:
        return [{"params": list(model.parameters()), "weight_decay": 0.0}]
    decay, keep = split_no_decay(model, list(cfg.no_decay))
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": keep, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
