"""Which network interface the inner backend binds to (`world.interface`): the one named, or on a multi-node run the
one that routes to the rendezvous endpoint, with a warning when a faster-looking interface sits unused."""
from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import shutil
import socket
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from dtk.errors import DtkError

log = logging.getLogger(__name__)
SYS_NET = Path("/sys/class/net")
VIRTUAL = ("lo", "docker", "veth", "br-", "virbr", "cni", "flannel", "cali", "tun", "tap", "ifb", "dummy")
"""Name prefixes of interfaces that never carry traffic to other hosts: never suggested as the faster one."""
ENV_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True, slots=True)
class Interface:
    name: str
    addresses: tuple[str, ...]
    speed_mbps: int | None
    """/sys/class/net/NAME/speed; None where the kernel does not say (virtual links, down links)."""
    up: bool


def interfaces() -> dict[str, Interface]:
    """Every interface of this host (namespace), with its addresses, link speed and state."""
    addrs = _addresses()
    out = {}
    for _, name in socket.if_nameindex():
        out[name] = Interface(name=name, addresses=tuple(addrs.get(name, ())), speed_mbps=_speed(name),
                              up=_read(SYS_NET / name / "operstate") in ("up", "unknown"))
    return out


def own_addresses() -> list[str]:
    """This host's (namespace's) addresses but the loopback ones: what a peer's broken connection names it by."""
    return sorted({a for i in interfaces().values() for a in i.addresses
                   if not (a.startswith("127.") or a == "::1")})


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _speed(name: str) -> int | None:
    text = _read(SYS_NET / name / "speed")
    try:
        mbps = int(text) if text is not None else -1
    except ValueError:
        return None
    return mbps if mbps > 0 else None


def _addresses() -> dict[str, list[str]]:
    """name -> addresses, from `ip -j addr` (every address, IPv6 too), else SIOCGIFADDR (the primary IPv4)."""
    if shutil.which("ip"):
        p = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True)
        if p.returncode == 0 and p.stdout.strip():
            return {i["ifname"]: [a["local"] for a in i.get("addr_info", []) if "local" in a]
                    for i in json.loads(p.stdout)}
    out: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue
            out[name] = [socket.inet_ntoa(packed[20:24])]
    return out


def route_source(host: str, port: int) -> str:
    """The local address this host sends from to reach host:port (a UDP connect sends nothing; it only routes)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise DtkError(f"--rdzv-endpoint: got {host}:{port}; the host name does not resolve here ({e.strerror})") \
            from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(addr)
        except OSError as e:
            raise DtkError(f"--rdzv-endpoint: got {host}:{port}; no route to it from this host ({e.strerror})") \
                from None
        return s.getsockname()[0]


def _owner(address: str, found: dict[str, Interface]) -> str | None:
    for iface in found.values():
        if address in iface.addresses:
            return iface.name
    if address.startswith("127."):
        return next((i.name for i in found.values() if i.name == "lo"), None)
    return None


def check_name(name: str | None) -> None:
    """A named interface must exist on this host: one line naming the field, the value and what exists."""
    if name is None:
        return
    found = interfaces()
    if name not in found:
        raise DtkError(f"world.interface: got {name!r}; interfaces on this host: {', '.join(sorted(found))}")


def _faster(chosen: Interface, found: dict[str, Interface]) -> Interface | None:
    """A real, up interface with an address whose link speed beats the chosen one's (both known)."""
    if chosen.speed_mbps is None:
        return None
    better = [i for i in found.values() if i.name != chosen.name and i.up and i.addresses and i.speed_mbps
              and not i.name.startswith(VIRTUAL) and i.speed_mbps > chosen.speed_mbps]
    return max(better, key=lambda i: i.speed_mbps or 0, default=None)  # `or 0`: never taken, each has a speed


def pick(name: str | None, *, endpoint: str) -> tuple[str, str]:
    """(interface, why): `name` if given (it must exist), else the interface that routes to `endpoint`."""
    check_name(name)
    if name is not None:
        return name, "set by world.interface"
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    source = route_source(host, int(port))
    why = f"routes to {endpoint}"
    if _loopback(source) and not _loopback(host) and host != "localhost":
        # The endpoint names this very host and resolves to loopback here (Debian's 127.0.1.1 line in /etc/hosts),
        # but the other hosts reach it over the network: bind where the default route leaves, never lo.
        try:
            source = route_source(DEFAULT_ROUTE_PROBE, 9)
        except DtkError:
            raise DtkError(f"world.interface: not set; {host} resolves to {source} (loopback) on this host and there "
                           f"is no default route; accepted: the name of the interface the other hosts reach") from None
        why = f"{host} is this host (it resolves to loopback here); the interface of the default route"
    found = interfaces()
    chosen = _owner(source, found)
    if chosen is None:
        raise DtkError(f"world.interface: not set, and the route to {endpoint} leaves from {source}, which no "
                       f"interface here holds; accepted: one of {', '.join(sorted(found))}")
    return chosen, why


DEFAULT_ROUTE_PROBE = "192.0.2.1"
"""An address of TEST-NET-1 (RFC 5737), reached only through the default route; a UDP connect sends nothing."""


def _loopback(address: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _speed_text(iface: Interface) -> str:
    return f"{iface.speed_mbps:,} Mb/s" if iface.speed_mbps else "speed unknown"


@functools.lru_cache(maxsize=None)
def _announced(name: str | None, endpoint: str, multi_node: bool) -> tuple[tuple[str, str], ...]:
    """Picked once per launcher (its `_env` runs for every rank and shadow); prints the choice once."""
    if name is None and not multi_node:
        return ()  # one node, nothing named: gloo's own default, as before
    if name is None and os.environ.get("GLOO_SOCKET_IFNAME"):
        return ()  # the user (or the test bed) bound it already
    chosen, why = pick(name, endpoint=endpoint)
    found = interfaces()
    iface = found[chosen]
    print(f"network: ranks bind to {chosen} ({', '.join(iface.addresses) or 'no address'}, {_speed_text(iface)}); "
          f"{why}", flush=True)
    faster = _faster(iface, found)
    if faster is not None:
        log.warning("network: %s (%s) looks faster than %s (%s) and is not used; if the other hosts are reachable "
                    "through it, set world.interface=%s", faster.name, _speed_text(faster), chosen,
                    _speed_text(iface), faster.name)
    return tuple((var, chosen) for var in ENV_VARS)


def backend_env(name: str | None, *, endpoint: str, multi_node: bool) -> dict[str, str]:
    """The environment that binds the ranks' inner backend (gloo and NCCL) to the chosen interface; {} when dtk
    leaves the choice to the backend (one node and nothing named, or GLOO_SOCKET_IFNAME already set)."""
    return dict(_announced(name, endpoint, multi_node))
