"""A user's `package.module:function` in a recipe (model.target, data.target): imported and checked before any rank
starts, so a typo is one line naming the field, not a traceback on every rank."""
from __future__ import annotations

import importlib
import os
import sys
from typing import Callable

from dtk.errors import DtkError


def import_target(field: str, value: str) -> Callable:
    """`field`'s `package.module:function` -> the function; DtkError (one line naming the field and the value) when
    the module cannot be imported or the name is not a callable in it."""
    module_name, sep, fn_name = value.partition(":")
    if not sep or not module_name or not fn_name:
        raise DtkError(f"{field}: got {value!r}; accepted: 'package.module:function'")
    # ranks run `python -m dtk.worker`, which finds modules in the current folder; the `dtk` script would not
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise DtkError(f"{field}: got {value!r}; cannot import {module_name!r} ({e})") from None
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise DtkError(f"{field}: got {value!r}; {module_name!r} has no {fn_name!r}")
    if not callable(fn):
        raise DtkError(f"{field}: got {value!r}; {module_name}.{fn_name} is a {type(fn).__name__}, not a function")
    return fn


def target_problem(field: str, value: str) -> str:
    """'' when `value` imports and names a callable, else the one-line error (for a recipe's list of mistakes)."""
    try:
        import_target(field, value)
    except DtkError as e:
        return e.lines[0]
    return ""
