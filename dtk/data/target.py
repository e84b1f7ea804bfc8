"""A user's data set as `data.target: package.module:function` (the escape hatch, as model.target is for models).

The contract: `function(seed=..., **data.kwargs)` returns an object with `spec` (a dtk.data.DataSpec) and
`batch(*, step, rank, micro, size) -> (inputs, targets)`, a pure function of its arguments and the seed (that is what
keeps resume and in-place recovery exact); optionally `val_batch(*, index, size)` for held-out evaluation.
"""
from __future__ import annotations

import importlib
from typing import Callable

from dtk.data import DataSpec
from dtk.errors import DtkError


def import_target(target: str) -> Callable:
    """The function `target` names; a user error names data.target when it cannot be had."""
    module_name, sep, fn_name = target.partition(":")
    if not sep or not module_name or not fn_name:
        raise DtkError(f"data.target: got {target!r}; accepted: 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise DtkError(f"data.target: got {target!r}; cannot import {module_name!r} ({e})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise DtkError(f"data.target: got {target!r}; {module_name!r} has no function {fn_name!r}")
    return fn


def target_problems(target: str) -> list[str]:
    """Pre-launch check of data.target: importable and callable (what the ranks would fail on first)."""
    try:
        import_target(target)
    except DtkError as e:
        return e.lines
    return []


def build_target(target: str, *, seed: int, kwargs: dict):
    data = import_target(target)(seed=seed, **kwargs)
    if not isinstance(getattr(data, "spec", None), DataSpec) or not callable(getattr(data, "batch", None)):
        raise DtkError(f"data.target: {target!r} returned a {type(data).__name__}; accepted: an object with `spec` "
                       f"(dtk.data.DataSpec) and batch(*, step, rank, micro, size)")
    return data
