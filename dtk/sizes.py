"""Byte sizes as people write them (`4K`, `64M`, `1G`, binary units as nccl-tests) and back."""
from __future__ import annotations

import re

from dtk.errors import DtkError

_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)(?:I?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str, flag: str) -> int:
    """'4K', '64M', '1G' (binary units, as nccl-tests) or plain bytes '4096' -> bytes."""
    m = _SIZE.match(text or "")
    if not m or int(m.group(1)) == 0:
        raise DtkError(f"{flag}: got '{text}'; accepted: a size like 4K, 1M, 64M")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def human_size(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)
