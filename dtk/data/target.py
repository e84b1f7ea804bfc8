"""A user's data set as `data.target: package.module:function` (the escape hatch, as model.target is for models).

The contract: `function(seed=..., **data.kwargs)` returns an object with `spec` (a dtk.data.DataSpec) and
`batch(*, step, rank, micro, size) -> (inputs, targets)`, a pure function of its arguments and the seed (that is what
keeps resume and in-place recovery exact); optionally `val_batch(*, index, size)` for held-out evaluation.
"""
from __future__ import annotations

from dtk.data import DataSpec
from dtk.errors import DtkError
from dtk.targets import import_target


def build_target(target: str, *, seed: int, kwargs: dict):
    data = import_target("data.target", target)(seed=seed, **kwargs)
    if not isinstance(getattr(data, "spec", None), DataSpec) or not callable(getattr(data, "batch", None)):
        raise DtkError(f"data.target: {target!r} returned a {type(data).__name__}; accepted: an object with `spec` "
                       f"(dtk.data.DataSpec) and batch(*, step, rank, micro, size)")
    return data
