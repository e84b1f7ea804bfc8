"""Congestion on the test bed: `host=I,rate=R` shapes host I's link in both directions, `pair=I-J,rate=R` only the
path between hosts I and J (htb + u32 `match ip dst` on each side). No netem in this kernel: bandwidth only."""
from __future__ import annotations

from dtk.resilience.congestion import _RATE, _UNITS, Congestion, parse
from dtk.testbed.net import IFNAME, Testbed, sh

__all__ = ["Congestion", "parse", "apply", "add", "clear", "qdiscs"]

BURST = "256kb"
"""tbf/htb reach their rate here only with a burst of 256kb or more."""


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
            assert c.pair is not None  # a congestion names a host or a pair
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
    assert m is not None  # rates were parsed when the congestion was
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
