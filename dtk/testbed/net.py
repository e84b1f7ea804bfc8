"""The test bed's hosts: one network namespace per host, each joined by a veth pair to a bridge that lives in
its own namespace, plus one veth from the root namespace so the launcher's store is reachable. Always torn down.

Names carry a tag (default: the owner's pid), so parallel runs never collide: namespaces `dtk<tag>h<I>` and
`dtk<tag>br`, the root end `dtk<tag>`; addresses 10.A.B.0/24 (host I is .I+1, the root end .254).
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtk.errors import DtkError

PREFIX = "dtk"
IFNAME = "eth0"
"""The host's interface inside its namespace (what GLOO_SOCKET_IFNAME names)."""
STATE_DIR = Path("/tmp/dtk-testbed")
_TAG = re.compile(r"^[a-z0-9]{1,10}$")
_CLONE_NEWNET = 0x40000000


def check_environment() -> None:
    """Refuse with one line where the test bed cannot work: no root, no `ip`, or no `ip netns`."""
    if os.geteuid() != 0:
        raise DtkError("--testbed: needs root (network namespaces and tc); this process runs as uid "
                       f"{os.geteuid()}")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise DtkError("--testbed: needs iproute2's `ip` and `tc` on PATH; install it (apt-get install -y iproute2)")
    p = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if p.returncode != 0:
        raise DtkError(f"--testbed: `ip netns` does not work here ({(p.stderr.strip() or 'no output')[:120]})")


def unavailable_reason() -> str | None:
    """Why the test bed cannot run here (for skipping tests), or None."""
    try:
        check_environment()
    except DtkError as e:
        return e.lines[0]
    return None


def sh(*argv: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {p.stderr.strip()}")
    return p


def namespaces() -> list[str]:
    out = sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _subnet(tag: str) -> tuple[int, int]:
    """10.A.B.0/24 from the tag, skipping any 10.A.B already routed in the root namespace."""
    routes = sh("ip", "-4", "route", "show", check=False).stdout
    h = int(hashlib.sha1(tag.encode()).hexdigest(), 16)
    for i in range(256):
        a, b = 100 + (h + i) % 150, (h >> 8) % 256
        if f"10.{a}.{b}." not in routes:
            return a, b
    raise RuntimeError("no free 10.x.y.0/24 subnet for the test bed")


@dataclass
class Testbed:
    """N hosts on one bridge. `up()` builds it, `down()` removes every namespace, link, qdisc and process."""

    __test__ = False  # not a pytest class, whatever its name

    n: int
    tag: str = field(default_factory=lambda: f"p{os.getpid()}")
    subnet: tuple[int, int] = (0, 0)
    owner: int = field(default_factory=os.getpid)
    shaping: list = field(default_factory=list)
    """The congestion specs in force (dtk.testbed.shape.Congestion)."""

    def __post_init__(self):
        if not _TAG.match(self.tag):
            raise DtkError(f"--name: got {self.tag!r}; accepted: 1-10 lowercase letters or digits")
        if not 1 <= self.n <= 64:
            raise DtkError(f"--testbed: got {self.n}; accepted: 1..64 hosts")

    # -- names and addresses --
    def host(self, i: int) -> str:
        return f"{PREFIX}{self.tag}h{i}"

    @property
    def bridge_ns(self) -> str:
        return f"{PREFIX}{self.tag}br"

    @property
    def root_link(self) -> str:
        return f"{PREFIX}{self.tag}"

    def ip(self, i: int) -> str:
        a, b = self.subnet
        return f"10.{a}.{b}.{i + 1}"

    @property
    def root_ip(self) -> str:
        a, b = self.subnet
        return f"10.{a}.{b}.254"

    def ns_names(self) -> list[str]:
        return [self.host(i) for i in range(self.n)] + [self.bridge_ns]

    # -- lifecycle --
    def up(self) -> "Testbed":
        check_environment()
        if any(name in namespaces() for name in self.ns_names()):
            raise DtkError(f"--name: a test bed tagged {self.tag!r} is up already; run `dtk testbed down --name {self.tag}`")
        if self.subnet == (0, 0):
            self.subnet = _subnet(self.tag)
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        self._save()
        return self

    def _build(self) -> None:
        br = self.bridge_ns
        sh("ip", "netns", "add", br)
        sh("ip", "link", "set", "lo", "up", ns=br)
        sh("ip", "link", "add", "br0", "type", "bridge", ns=br)
        sh("ip", "link", "set", "br0", "up", ns=br)
        for i in range(self.n):
            ns, tmp = self.host(i), f"{PREFIX}{self.tag}x{i}"
            sh("ip", "netns", "add", ns)
            # created inside the bridge namespace, the host end then moves to its own namespace
            sh("ip", "link", "add", f"h{i}", "type", "veth", "peer", "name", tmp, ns=br)
            sh("ip", "link", "set", tmp, "netns", ns, ns=br)
            sh("ip", "link", "set", tmp, "name", IFNAME, ns=ns)
            sh("ip", "addr", "add", f"{self.ip(i)}/24", "dev", IFNAME, ns=ns)
            sh("ip", "link", "set", IFNAME, "up", ns=ns)
            sh("ip", "link", "set", "lo", "up", ns=ns)
            sh("ip", "link", "set", f"h{i}", "master", "br0", ns=br)
            sh("ip", "link", "set", f"h{i}", "up", ns=br)
        sh("ip", "link", "add", self.root_link, "type", "veth", "peer", "name", "root", "netns", br)
        sh("ip", "link", "set", "root", "master", "br0", ns=br)
        sh("ip", "link", "set", "root", "up", ns=br)
        sh("ip", "addr", "add", f"{self.root_ip}/24", "dev", self.root_link)
        sh("ip", "link", "set", self.root_link, "up")

    def down(self) -> None:
        """Kill every process inside the namespaces, then delete them (and with them the links and qdiscs)."""
        teardown(self.tag)

    def __enter__(self) -> "Testbed":
        return self.up() if not self.is_up() else self

    def __exit__(self, *exc) -> None:
        self.down()

    def is_up(self) -> bool:
        return self.bridge_ns in namespaces()

    # -- running ranks on it --
    def spawn_prefix(self, i: int) -> tuple[list[str], dict[str, str]]:
        """The argv prefix and environment that run a command as host `i` (for a launcher's Popen)."""
        return ["ip", "netns", "exec", self.host(i)], {"GLOO_SOCKET_IFNAME": IFNAME, "DTK_TESTBED_HOST": self.ip(i)}

    def enter(self, i: int) -> None:
        """Move the calling process (call it before it starts threads) into host `i`'s namespace."""
        enter_namespace(self.host(i))
        os.environ["GLOO_SOCKET_IFNAME"] = IFNAME

    def _save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state = {"tag": self.tag, "n": self.n, "subnet": list(self.subnet), "owner": self.owner,
                 "hosts": [{"ns": self.host(i), "ip": self.ip(i)} for i in range(self.n)],
                 "root": {"link": self.root_link, "ip": self.root_ip},
                 "shaping": [c.spec() for c in self.shaping]}
        (STATE_DIR / f"{self.tag}.json").write_text(json.dumps(state, indent=1) + "\n")

    @classmethod
    def load(cls, tag: str) -> "Testbed":
        path = STATE_DIR / f"{tag}.json"
        if not path.exists():
            raise DtkError(f"--name: got {tag!r}; no test bed with that name is up (see `dtk testbed status`)")
        s = json.loads(path.read_text())
        return cls(n=s["n"], tag=s["tag"], subnet=tuple(s["subnet"]), owner=s["owner"])


def enter_namespace(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")
    finally:
        os.close(fd)


def _pids_in(ns: str) -> list[int]:
    out = sh("ip", "netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def teardown(tag: str) -> None:
    """Remove the test bed `tag`: processes inside first (a namespace with a process in it cannot go), then the
    namespaces, the root link and the state file. Safe to call twice."""
    names = [ns for ns in namespaces() if re.fullmatch(rf"{PREFIX}{tag}(h\d+|br)", ns)]
    for ns in names:
        for pid in _pids_in(ns):
            if pid != os.getpid():
                with _ignore():
                    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    for ns in names:
        while _pids_in(ns) and time.monotonic() < deadline:
            time.sleep(0.02)
        sh("ip", "netns", "del", ns, check=False)
    sh("ip", "link", "del", f"{PREFIX}{tag}", check=False)  # gone with the bridge namespace, unless half-built
    (STATE_DIR / f"{tag}.json").unlink(missing_ok=True)


class _ignore:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], (ProcessLookupError, PermissionError))


def status() -> list[dict]:
    """Every dtk test bed on this machine: tag, hosts, owner pid (alive or stale), shaping in force."""
    tags = sorted({m.group(1) for ns in namespaces() if (m := re.fullmatch(rf"{PREFIX}([a-z0-9]+)(?:h\d+|br)", ns))})
    out = []
    for tag in tags:
        path = STATE_DIR / f"{tag}.json"
        s: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"tag": tag}
        hosts = sorted(ns for ns in namespaces() if re.fullmatch(rf"{PREFIX}{tag}h\d+", ns))
        owner = s.get("owner")
        out.append({"tag": tag, "hosts": len(hosts), "subnet": s.get("subnet"), "owner": owner,
                    "stale": owner is not None and tag.startswith("p") and not _pid_alive(owner),
                    "shaping": s.get("shaping", [])})
    return out


def remove_stale() -> list[str]:
    """Tear down test beds whose owning process is gone (a run killed before it could clean up)."""
    gone = [s["tag"] for s in status() if s["stale"]]
    for tag in gone:
        teardown(tag)
    return gone
