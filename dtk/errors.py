"""The one error type for mistakes a user can make (recipe, flags, environment).

The CLI prints each line of a `DtkError` as `error: <line>` and exits with code 2; anything else is a bug
and keeps its traceback.
"""
from __future__ import annotations


class DtkError(Exception):
    """A user error. `lines` are the one-line messages, each naming the field, the value and what is accepted."""

    def __init__(self, *lines: str):
        self.lines = [line for line in lines if line]
        super().__init__("\n".join(self.lines))


USER_ERROR_EXIT = 2
RUN_FAILED_EXIT = 1
