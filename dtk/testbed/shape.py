"""Congestion on the test bed: `host=I,rate=R` shapes host I's link in both directions, `pair=I-J,rate=R` only the
path between hosts I and J (htb + u32 `match ip dst` on each side). No netem in this kernel: bandwidth only."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from dtk.errors import DtkError
from dtk.testbed.net import IFNAME, Testbed, sh

_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit)$")
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
BURST = "256kb"
"""tbf/htb reach their rate here only with a burst of 256kb or more."""


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
        where = f"host={self.host}" if self.host is not None else f"pair={self.pair[0]}-{self.pair[1]}"
        return f"{where},rate={self.rate}"

    def as_fault(self) -> str:
        """The `--fault` spelling, step included: congest:pair=0-1,rate=200mbit,step=5."""
        return f"congest:{self.spec()}" + (f",step={self.step}" if self.step is not None else "")

    @property
    def bits_per_second(self) -> float:
        m = _RATE.match(self.rate)
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
            c = Congestion(rate=rate, host=int(fields["host"]), step=step)
            ids = [c.host]
        else:
            i, _, j = fields["pair"].partition("-")
            c = Congestion(rate=rate, pair=(int(i), int(j)), step=step)
            ids = list(c.pair)
    except ValueError:
        raise DtkError(f"{flag}: got {spec!r}; hosts and step are whole numbers: host=2 or pair=0-1, step=5") from None
    if step is not None and step < 0:
        raise DtkError(f"{flag}: got step={step} in {spec!r}; accepted: a step >= 0")
    if any(h < 0 or (hosts is not None and h >= hosts) for h in ids) or (c.pair and c.pair[0] == c.pair[1]):
        raise DtkError(f"{flag}: got {spec!r}; accepted hosts: {limit}, two different ones for a pair")
    return c


def apply(bed: Testbed, specs: list[Congestion]) -> None:
    """Make `specs` the congestion in force (replacing what was): each touched device's qdisc is rebuilt."""
    clear(bed)
    bed.shaping = list(specs)
    # (namespace, device) -> (default rate or None, {dst ip: rate})
    devices: dict[tuple[str, str], tuple[str | None, dict[str, str]]] = {}

    def rule(ns, dev, *, default=None, dst=None, rate):
        d, pairs = devices.get((ns, dev), (None, {}))
        if default is not None:
            d = default
        if dst is not None:
            pairs[dst] = rate
        devices[(ns, dev)] = (d, pairs)

    for c in specs:
        if c.host is not None:
            rule(bed.host(c.host), IFNAME, default=c.rate, rate=c.rate)        # host -> bridge
            rule(bed.bridge_ns, f"h{c.host}", default=c.rate, rate=c.rate)     # bridge -> host
        else:
            i, j = c.pair
            rule(bed.host(i), IFNAME, dst=bed.ip(j), rate=c.rate)
            rule(bed.host(j), IFNAME, dst=bed.ip(i), rate=c.rate)
    for (ns, dev), (default, pairs) in devices.items():
        _htb(ns, dev, default, pairs)
    bed._save()


def add(bed: Testbed, spec: Congestion) -> None:
    """One more congestion on top of what is in force (a `congest:` fault firing at its step, launcher side)."""
    apply(bed, [c for c in bed.shaping if (c.host, c.pair) != (spec.host, spec.pair)] + [spec])


def _htb(ns: str, dev: str, default: str | None, pairs: dict[str, str]) -> None:
    # htb without a default class sends unmatched traffic straight out, unshaped
    sh("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", *(["default", "3"] if default else []), ns=ns)
    if default:
        # A shaped link carries data one way and the other way's ACKs: queued behind 256 KB of data, ACKs stall the
        # reverse flow (no fq_codel or sfq in this kernel). Small packets get their own class, served first.
        sh("tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", default,
           "burst", BURST, "cburst", BURST, ns=ns)
        for cid, share, prio in (("1:2", 0.1, "0"), ("1:3", 0.9, "1")):
            sh("tc", "class", "add", "dev", dev, "parent", "1:1", "classid", cid, "htb",
               "rate", _scaled(default, share), "ceil", default, "burst", BURST, "cburst", BURST, "prio", prio, ns=ns)
        sh("tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
           "match", "ip", "protocol", "6", "0xff", "match", "u16", "0x0000", "0xff80", "at", "2",
           "flowid", "1:2", ns=ns)  # TCP packets under 128 bytes: ACKs
    for k, (dst, rate) in enumerate(sorted(pairs.items()), start=10):
        sh("tc", "class", "add", "dev", dev, "parent", "1:", "classid", f"1:{k}", "htb", "rate", rate,
           "burst", BURST, "cburst", BURST, ns=ns)
        sh("tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "2", "u32",
           "match", "ip", "dst", f"{dst}/32", "flowid", f"1:{k}", ns=ns)


def _scaled(rate: str, share: float) -> str:
    m = _RATE.match(rate)
    return f"{max(1, int(float(rate[: m.start(2)]) * _UNITS[m.group(2)] * share))}bit"


def clear(bed: Testbed) -> None:
    """Remove every qdisc dtk put on the test bed (devices go back to their default, unshaped)."""
    for i in range(bed.n):
        sh("tc", "qdisc", "del", "dev", IFNAME, "root", ns=bed.host(i), check=False)
        sh("tc", "qdisc", "del", "dev", f"h{i}", "root", ns=bed.bridge_ns, check=False)
    bed.shaping = []


def qdiscs(bed: Testbed) -> list[str]:
    """The non-default qdiscs on the test bed's devices (what `clear` and teardown must leave empty)."""
    out = []
    for ns, dev in [(bed.host(i), IFNAME) for i in range(bed.n)] + [(bed.bridge_ns, f"h{i}") for i in range(bed.n)]:
        text = sh("tc", "qdisc", "show", "dev", dev, ns=ns, check=False).stdout
        out += [f"{ns}/{dev}: {line}" for line in text.splitlines() if line.startswith(("qdisc htb", "qdisc tbf"))]
    return out
