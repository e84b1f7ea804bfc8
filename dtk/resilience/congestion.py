"""A congestion, as a user spells it (`--congest pair=0-1,rate=200mbit`, or the fault `congest:...,step=S`): what
it shapes and from when. The test bed (dtk.testbed.shape) applies it; faults parse it next to the rank faults."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from dtk.errors import DtkError

_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit)$")
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


@dataclass(frozen=True, kw_only=True)
class Congestion:
    rate: str
    host: int | None = None
    pair: tuple[int, int] | None = None
    step: int | None = None
    """As a fault (`congest:...,step=S`): in force from step S on (rank 0 waits at step S until the test bed's driver
    has shaped the link); None: at once."""

    kind: ClassVar[str] = "congest"
    """As a fault (dtk.resilience.faults), next to kill, hang, ..."""

    def spec(self) -> str:
        where = f"host={self.host}" if self.pair is None else f"pair={self.pair[0]}-{self.pair[1]}"
        return f"{where},rate={self.rate}"

    def as_fault(self) -> str:
        """The `--fault` spelling, step included: congest:pair=0-1,rate=200mbit,step=5."""
        return f"congest:{self.spec()}" + (f",step={self.step}" if self.step is not None else "")

    @property
    def bits_per_second(self) -> float:
        m = _RATE.match(self.rate)
        assert m is not None, "parse() accepts only a tc rate"
        return float(self.rate[: m.start(2)]) * _UNITS[m.group(2)]


def parse(spec: str, *, hosts: int | None = None, flag: str = "--congest") -> Congestion:
    """`pair=0-1,rate=200mbit` or `host=2,rate=200mbit` (also with a leading `congest:`) -> Congestion."""
    text = spec.removeprefix("congest:")
    fields = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in ("host", "pair", "rate", "step"):
            raise DtkError(f"{flag}: got {item!r} in {spec!r}; accepted keys: host=I or pair=I-J, rate=R (e.g. 200mbit)")
        fields[key] = value.strip()
    rate = fields.get("rate", "")
    if not _RATE.match(rate):
        raise DtkError(f"{flag}: got rate={rate!r} in {spec!r}; accepted: a tc rate like 200mbit, 1gbit, 500kbit")
    if ("host" in fields) == ("pair" in fields):
        raise DtkError(f"{flag}: got {spec!r}; accepted: exactly one of host=I or pair=I-J")
    limit = f"0..{hosts - 1}" if hosts else "0 or more"
    try:
        step = int(fields["step"]) if "step" in fields else None
        if "host" in fields:
            ids = [int(fields["host"])]
            c = Congestion(rate=rate, host=ids[0], step=step)
        else:
            i, _, j = fields["pair"].partition("-")
            ids = [int(i), int(j)]
            c = Congestion(rate=rate, pair=(ids[0], ids[1]), step=step)
    except ValueError:
        raise DtkError(f"{flag}: got {spec!r}; hosts and step are whole numbers: host=2 or pair=0-1, step=5") from None
    if step is not None and step < 0:
        raise DtkError(f"{flag}: got step={step} in {spec!r}; accepted: a step >= 0")
    if any(h < 0 or (hosts is not None and h >= hosts) for h in ids) or (c.pair and c.pair[0] == c.pair[1]):
        raise DtkError(f"{flag}: got {spec!r}; accepted hosts: {limit}, two different ones for a pair")
    return c
