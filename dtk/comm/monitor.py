"""Flow statistics for the comm planner: per-peer throughput from timed transfers (dtk's p2p pieces, a cheap
pairwise probe) and the time of native collectives against their own EWMA baseline, which says when to probe."""
from __future__ import annotations

import math
import threading
import time

import torch

PROBE_BYTES = 1 << 20
"""Probe message: above the shapers' 256 KB burst, so a shaped link shows its rate; ~40 ms at 200 mbit."""
MEASURABLE_BYTES = 256 << 10
"""Calls and pieces below this size are latency, not bandwidth: they say nothing about a link's rate."""
SLOWDOWN = 2.0
"""A native collective this many times slower than its baseline (same kind and size class) asks for a probe."""


def tournament(p: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs covering every pair once (circle method): each host talks to one peer per round,
    so a probe measures the path, not the host's link shared between several flows."""
    ids = list(range(p)) + ([None] if p % 2 else [])
    m = len(ids)
    rounds = []
    for _ in range(m - 1):
        pairs = [(ids[i], ids[m - 1 - i]) for i in range(m // 2)]
        rounds.append([(a, b) for a, b in pairs if a is not None and b is not None])
        ids = [ids[0], ids[-1]] + ids[1:-1]
    return rounds


class LinkMonitor:
    """What one rank knows about its links: `bw[j]` bytes/s from peer j (latest), and per (kind, size class)
    an EWMA of native collectives' seconds per byte."""

    def __init__(self, *, rank: int, size: int, alpha: float = 0.3):
        self.rank, self.size, self.alpha = rank, size, alpha
        self.bw: list[float] = [math.nan] * size
        self.baseline: dict[tuple[str, int], float] = {}
        self.slow: list[dict] = []
        """Native collectives seen slower than their baseline since the last boundary (the evidence)."""
        self.lock = threading.Lock()

    # -- from the traffic itself --
    def observe_native(self, kind: str, size_bytes: int, seconds: float) -> None:
        if size_bytes < MEASURABLE_BYTES or seconds <= 0:
            return
        key = (kind, size_bytes.bit_length())
        spb = seconds / size_bytes
        with self.lock:
            base = self.baseline.get(key)
            if base is not None and spb > SLOWDOWN * base:
                self.slow.append({"kind": kind, "size_bytes": size_bytes, "seconds": round(seconds, 6),
                                  "baseline_seconds": round(base * size_bytes, 6)})
                return  # a congested sample does not become the baseline
            self.baseline[key] = spb if base is None else (1 - self.alpha) * base + self.alpha * spb

    def observe_p2p(self, timings: list[tuple[int, int, float]]) -> None:
        """(peer, bytes, seconds) of received pieces; only pieces large enough to measure a rate count."""
        per: dict[int, list[float]] = {}
        for peer, nbytes, seconds in timings:
            if nbytes >= MEASURABLE_BYTES and seconds > 0:
                per.setdefault(peer, [0, 0])
                per[peer][0] += nbytes
                per[peer][1] += seconds
        with self.lock:
            for peer, (b, s) in per.items():
                rate = b / s
                old = self.bw[peer]
                self.bw[peer] = rate if math.isnan(old) else (1 - self.alpha) * old + self.alpha * rate

    def take_slow(self) -> list[dict]:
        with self.lock:
            out, self.slow = self.slow, []
        return out

    # -- a probe, only when the traffic has nothing to say --
    def probe(self, pg, *, nbytes: int = PROBE_BYTES, tag_base: int = 1 << 30, passes: int = 2) -> list[float]:
        """Exchange `nbytes` with every peer, one peer at a time (tournament rounds), `passes` times; sets and
        returns bw[j], the best pass (on a loaded machine one pass can stall; a stall only ever lowers a rate)."""
        best = [0.0] * self.size
        for k in range(passes):
            rates = self._probe_once(pg, nbytes=nbytes, tag_base=tag_base + 64 * k)
            best = [max(a, b) for a, b in zip(best, rates)]
        self.bw = [b if b > 0 else math.nan for b in best]
        return list(self.bw)

    def _probe_once(self, pg, *, nbytes: int, tag_base: int) -> list[float]:
        rates = [0.0] * self.size
        buf_out = torch.zeros(nbytes // 4)
        buf_in = torch.empty_like(buf_out)
        ping_out, ping_in = torch.zeros(1), torch.empty(1)
        for r, pairs in enumerate(tournament(self.size)):
            peer = next((b if a == self.rank else a for a, b in pairs if self.rank in (a, b)), None)
            if peer is None:
                continue
            # a tiny exchange first, so the timing starts when both ends are in this round
            ping = pg.recv([ping_in], peer, tag_base + 2 * r)
            pg.send([ping_out], peer, tag_base + 2 * r).wait()
            ping.wait()
            t0 = time.perf_counter()
            recv = pg.recv([buf_in], peer, tag_base + 2 * r + 1)
            send = pg.send([buf_out], peer, tag_base + 2 * r + 1)
            recv.wait()
            seconds = time.perf_counter() - t0
            send.wait()
            rates[peer] = nbytes / seconds
        return rates
