"""A child of a dtk process dies with its parent (Linux's parent-death signal): the ranks with their launcher, a
test bed's launchers with its driver. Called in the child between fork and exec (a `preexec_fn`)."""
from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: a child may outlive a parent killed with SIGKILL
