"""FSDP's wrap units for any model: the classes named in `strategy.wrap`, else the model's `_no_split_modules`
(transformers), else the members of its largest nn.ModuleList of repeated blocks. The root is wrapped last, apart."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from torch import nn

from dtk.errors import DtkError


@dataclass(frozen=True, kw_only=True, slots=True)
class WrapUnits:
    names: list[str]
    """Qualified names of the units, deepest first: fully_shard must see a child before its parent."""
    modules: list[nn.Module]
    classes: list[str]
    """The units' class names, taken before wrapping (fully_shard renames a class to FSDP<name>)."""
    source: str
    """Why these: 'strategy.wrap', '_no_split_modules', 'largest ModuleList <name>', or 'none'."""
    root: str
    """The root's class (its own unit: what no block holds, such as embeddings and the head)."""

    def summary(self) -> dict:
        """What summary.json shows as fsdp_wrap_units: the class names, their count, and where they came from."""
        return {"count": len(self.modules), "classes": dict(Counter(self.classes)),
                "source": self.source, "root": self.root}

    def describe(self) -> str:
        classes = ", ".join(f"{n} x {c}" for c, n in self.summary()["classes"].items()) or "no units"
        return f"{classes} (from {self.source}) + root {self.root}"


def _no_split_classes(model: nn.Module) -> set[str]:
    """transformers models name the blocks that must not be split (a class attribute, a set on instances in v5);
    a model that wraps a transformers model inherits them."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return names


def _largest_block_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The nn.ModuleList of same-class blocks holding the most parameters (a one-block stack counts too)."""
    best, best_size = None, 0
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or m is model or len(m) == 0:
            continue
        if len({type(b) for b in m}) != 1 or isinstance(m[0], (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            continue
        size = sum(p.numel() for p in m.parameters())
        if size > best_size:
            best, best_size = (name, m), size
    return best


def _depth(name: str) -> int:
    return name.count(".") + 1


def _check_ties(model: nn.Module, unit_names: list[str]) -> None:
    """FSDP shards each parameter in one unit: both ends of a tie (input and output embedding) must share one."""
    owners: dict[int, set[str]] = {}
    by_depth = sorted(unit_names, key=_depth, reverse=True)
    for pname, p in model.named_parameters(remove_duplicate=False):
        unit = next((u for u in by_depth if pname.startswith(u + ".")), "<root>")
        owners.setdefault(id(p), set()).add(unit)
    for units in owners.values():
        if len(units) > 1:
            raise DtkError(f"strategy.wrap: the units {', '.join(sorted(units))} share a tied parameter; accepted: "
                           "units that hold both ends of a tie, or leave the tied modules to the root")


def find_wrap_units(model: nn.Module, *, names: Sequence[str] = ()) -> WrapUnits:
    """The submodules FSDP shards one by one; `names` are class names given by the user (strategy.wrap)."""
    named = [(n, m) for n, m in model.named_modules() if m is not model]
    if names:
        present = {type(m).__name__ for _, m in model.named_modules()}
        missing = [c for c in names if c not in present]
        if missing:
            candidates = sorted({type(m).__name__ for _, m in named if any(True for _ in m.parameters())})
            raise DtkError(f"strategy.wrap: got {missing[0]!r}; no module of that class in "
                           f"{type(model).__name__}; accepted: its classes, e.g. {', '.join(candidates[:12])}")
        chosen, source = [(n, m) for n, m in named if type(m).__name__ in names], "strategy.wrap"
    else:
        no_split = _no_split_classes(model)
        chosen = [(n, m) for n, m in named if type(m).__name__ in no_split]
        source = "_no_split_modules"
        if not chosen:
            found = _largest_block_list(model)
            if found:
                chosen = [(f"{found[0]}.{i}", b) for i, b in enumerate(found[1])]
                source = f"largest ModuleList {found[0]}"
            else:
                source = "none"
    chosen.sort(key=lambda nm: _depth(nm[0]), reverse=True)
    _check_ties(model, [n for n, _ in chosen])
    return WrapUnits(names=[n for n, _ in chosen], modules=[m for _, m in chosen],
                     classes=[type(m).__name__ for _, m in chosen], source=source,
                     root=type(model).__name__)
