"""The seam's process-wide state: one `Seam` shared by every DtkGroup of a process (counters, the failure flag,
the generation), and the byte counters it keeps. dtk.comm.group holds the groups; this file knows them only as
`SeamGroup`."""
from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # dispatch imports the seam at run time; here the router is only named
    from dtk.comm.dispatch import Router

log = logging.getLogger("dtk.comm.group")

_BROKEN = re.compile(r"(?:Read error|Write error|Connection closed by peer|Socket closed) \[([^\]]+)\]:\d+")


def broken_peer(message: str) -> str | None:
    """The peer's address in a gloo error that says the connection to it broke ("Read error [10.0.1.2]:41234:
    Connection reset by peer", "Connection closed by peer [10.0.1.2]:41234"): its process died, or its host did.
    None for any other error (a timeout names no peer)."""
    found = _BROKEN.search(message)
    return found.group(1) if found else None


class SeamGroup(Protocol):
    """What the seam asks of each group it holds (dtk.comm.group.DtkGroup)."""

    outstanding: set
    router: Router | None

    def size(self) -> int: ...

    def release_outstanding(self) -> None: ...

    def rebuild(self, generation: int) -> None: ...

    def assume_rank(self, rank: int) -> None: ...


class ReducedSink(Protocol):
    """Takes what a reduce-scatter reduced (dtk.resilience.reduced.ReducedGrads, resilience.roll_forward)."""

    def add(self, buf, output) -> None:
        """buf: the all-reduced input, every rank's chunk; output: this rank's chunk's destination."""


# Bytes a rank moves on the wire per byte of the collective's buffer (ring algorithms, as nccl-tests' busbw).
def bus_factor(kind: str, n: int) -> float:
    if n <= 1:
        return 0.0
    return {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "reduce": (n - 1) / n,  # the ring's volume: a reduce is a reduce-scatter whose chunks all land on the root
        "all_to_all": (n - 1) / n,
        "gather": (n - 1) / n,
        "scatter": (n - 1) / n,
        "barrier": 0.0,
    }.get(kind, 1.0)


@dataclass
class KindStats:
    calls: int = 0
    size_bytes: int = 0
    """The collective's buffer, as nccl-tests' "size" (all-gather: output; reduce-scatter: input)."""
    bytes: float = 0.0
    """What this rank moves on the wire: size x bus factor."""
    seconds: float = 0.0


@dataclass
class CommStats:
    """Counters of one process, over all its groups; the trainer takes them at every step boundary."""

    kinds: dict[str, KindStats] = field(default_factory=dict)
    peer_bytes: dict[int, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def issued(self, kind: str, size_bytes: int, n: int, peer: int | None = None) -> None:
        with self.lock:
            k = self.kinds.get(kind) or self.kinds.setdefault(kind, KindStats())
            k.calls += 1
            k.size_bytes += size_bytes
            k.bytes += size_bytes * bus_factor(kind, n)
            if peer is not None:
                self.peer_bytes[peer] = self.peer_bytes.get(peer, 0) + size_bytes

    def finished(self, kind: str, seconds: float) -> None:
        with self.lock:
            (self.kinds.get(kind) or self.kinds.setdefault(kind, KindStats())).seconds += seconds

    def take(self) -> dict:
        """The counters since the last take, as plain numbers; resets them."""
        with self.lock:
            out: dict = {
                "by_kind": {k: {"calls": s.calls, "bytes": s.bytes, "size_bytes": s.size_bytes, "seconds": s.seconds}
                            for k, s in sorted(self.kinds.items())},
                "peer_bytes": {str(p): b for p, b in sorted(self.peer_bytes.items())},
            }
            self.kinds, self.peer_bytes = {}, {}
        out["bytes"] = sum(k["bytes"] for k in out["by_kind"].values())
        out["seconds"] = sum(k["seconds"] for k in out["by_kind"].values())
        return out


class Seam:
    """Per-process state shared by every DtkGroup: counters, the failure flag, the generation."""

    stats = CommStats()
    groups: list[SeamGroup] = []
    failure: str | None = None
    failed_generation = -1
    failed_at = 0.0
    """Wall-clock time at which this process's collectives were released (the seam saw the failure)."""
    broken: tuple[int, str] | None = None
    """(generation, address): the peer the first broken connection of a failed generation named; the rank's control
    thread posts it for the launcher, which maps it to a node (a lost host is found without waiting for silence)."""
    generation = 0
    comm_mode = "native"
    """recipe comm.mode: "adaptive" gives each DtkGroup a router (dtk.comm.dispatch) that follows the planner."""
    joining = False
    """True in a process that is built before it joins a running job: its groups stay local until reconfigured."""
    reduced: ReducedSink | None = None
    """Where strategy reduce-scatters on gloo hand what they reduced (resilience.roll_forward); None: nowhere."""
    cut = 0
    """Collectives completed without their result because a peer failed (skipped, or released while outstanding).
    A step whose update issued none kept it whole on this rank, even if the failure was seen before it was counted."""
    _counting = threading.local()

    @classmethod
    def counting(cls) -> bool:
        return getattr(cls._counting, "on", True)

    @classmethod
    @contextlib.contextmanager
    def uncounted(cls):
        """dtk's own bookkeeping (loss gather, state repair) is not strategy traffic."""
        cls._counting.on = False
        try:
            yield
        finally:
            cls._counting.on = True

    @classmethod
    def release(cls, reason: str, *, generation: int | None = None, peer: str | None = None) -> None:
        """A peer failed: complete every outstanding collective now (its result is meaningless) and flag the step.
        A notice about an older generation (a retired group's late error) is ignored. `peer`: the address a broken
        connection named."""
        if generation is not None and generation != cls.generation:
            return
        if peer is not None and (cls.broken is None or cls.broken[0] != cls.generation):
            cls.broken = (cls.generation, peer)
        if cls.failed_generation != cls.generation:
            cls.failed_generation = cls.generation
            cls.failure = reason
            cls.failed_at = time.time()
            log.warning("collectives released: %s", reason)
        for g in list(cls.groups):
            g.release_outstanding()

    @classmethod
    def take_failure(cls) -> str | None:
        """The reason of this generation's failure (once); the generation stays failed until reconfigured."""
        reason, cls.failure = cls.failure, None
        return reason

    @classmethod
    def assume_rank(cls, rank: int, *, world: int) -> None:
        """A shadow takes `rank` in every group it has made so far: the world, and the world-sized groups an engine
        made before the promotion (DeepSpeed's data-parallel group, made once and cached per process)."""
        for g in cls.groups:
            if g.size() != world:
                raise RuntimeError(f"a group of {g.size()} ranks was made before the promotion; a shadow can only "
                                   f"take a rank in groups of the whole world ({world})")
            g.assume_rank(rank)

    @classmethod
    def reconfigure(cls, generation: int) -> float:
        """Rebuild the inner group of every DtkGroup, in creation order, for `generation`; returns seconds."""
        t0 = time.perf_counter()
        cls.generation = generation
        cls.joining = False
        cls.failure = None
        for g in cls.groups:
            g.rebuild(generation)
        return time.perf_counter() - t0
