"""dtk's collectives built from point-to-point ops of an inner group: ring all-reduce / reduce-scatter / all-gather
in any rank order, tree reduce + broadcast from any root (binomial or binary), and a hierarchical all-reduce.

All sum; all send a large tensor in chunks and pipeline them (a piece is reduced while the next is on the wire).
Every rank calls the same function with the same arguments; the result equals the native op's up to
floating-point reassociation of the sums. The functions block until done: the seam runs them on a worker thread.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from torch.distributed import Work

CHUNK_BYTES = 1 << 20
"""Default largest piece on the wire."""

_calls: dict[int, itertools.count] = {}


def next_call(pg) -> int:
    """The next call number on `pg`: every rank issues a group's calls in the same order, so numbers agree."""
    return next(_calls.setdefault(id(pg), itertools.count()))


class PointToPoint(Protocol):
    """What P2P asks of its inner group (gloo's, or a ProcessGroup)."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, /) -> Work: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int, /) -> Work: ...

    def rank(self) -> int: ...

    def size(self) -> int: ...


@dataclass
class P2P:
    """Tagged isend/irecv on one inner group for one collective call, timing each transfer per peer."""

    pg: PointToPoint
    """A group with `send(tensors, dst, tag)` / `recv(tensors, src, tag)` returning works (gloo's)."""
    call: int = -1
    """Which call on the group this is (default: the next): tags of different calls never meet."""
    timings: list = field(default_factory=list)
    """(peer, bytes, seconds) of every received piece: seconds from its posting to its arrival."""

    def __post_init__(self):
        if self.call < 0:
            self.call = next_call(self.pg)

    def tag(self, phase: int, step: int, piece: int) -> int:
        # gloo tags are 31-bit ints: call (6 bits; dtk probes use bit 30), phase (4), step (6), piece (14); the sender and the receiver
        # of a message name it by what it is, so both compute the same tag
        return (self.call % 64) << 24 | (phase % 16) << 20 | (step % 64) << 14 | piece % 16384

    def isend(self, t: torch.Tensor, peer: int, key: int) -> "_Send":
        return _Send(self.pg.send([t], peer, key))

    def irecv(self, t: torch.Tensor, peer: int, key: int) -> "_Recv":
        return _Recv(self, self.pg.recv([t], peer, key), peer, t.numel() * t.element_size())


class _Send:
    """A send that may be waited on more than once (gloo's send work must be waited exactly once)."""

    def __init__(self, work):
        self.work, self.done = work, False

    def wait(self) -> None:
        if not self.done:
            self.work.wait()
            self.done = True


class _Recv:
    def __init__(self, p2p: P2P, work, peer: int, nbytes: int):
        self.p2p, self.work, self.peer, self.nbytes, self.t0 = p2p, work, peer, nbytes, time.perf_counter()

    def wait(self) -> None:
        self.work.wait()
        self.p2p.timings.append((self.peer, self.nbytes, time.perf_counter() - self.t0))


def _pieces(t: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    """Contiguous views of a 1-D tensor, each at most chunk_bytes (at least one element)."""
    step = max(1, chunk_bytes // max(1, t.element_size()))
    return list(t.split(step)) if t.numel() else [t]


def _segments(flat: torch.Tensor, p: int) -> list[torch.Tensor]:
    return list(torch.tensor_split(flat, p))


def _wait_all(works) -> None:
    for w in works:
        w.wait()


# -- rings ----------------------------------------------------------------------------------------------------

def _ring_reduce_scatter(p2p: P2P, segs: Sequence[torch.Tensor], me: int, order: Sequence[int],
                         owner: Callable[[int], int], chunk_bytes: int, phase: int = 0) -> None:
    """In place over `segs`: afterwards segs[owner(k)] on position k holds the sum of every rank's segment.
    At step s, position k sends the partial segment owner(k-1-s) to the next and adds the previous one's
    owner(k-2-s) into its own copy."""
    p, k = len(order), order.index(me)
    nxt, prv = order[(k + 1) % p], order[(k - 1) % p]
    sends = []
    for s in range(p - 1):
        out, inc = segs[owner((k - 1 - s) % p)], segs[owner((k - 2 - s) % p)]
        bufs = [torch.empty_like(x) for x in _pieces(inc, chunk_bytes)]
        recvs = [p2p.irecv(b, prv, p2p.tag(phase, s, i)) for i, b in enumerate(bufs)]
        sends += [p2p.isend(x, nxt, p2p.tag(phase, s, i)) for i, x in enumerate(_pieces(out, chunk_bytes))]
        for x, b, r in zip(_pieces(inc, chunk_bytes), bufs, recvs):
            r.wait()
            x.add_(b)
        _wait_all(sends)  # the next step sends what was just reduced; the old sends must be out first
        sends = []


def _ring_all_gather(p2p: P2P, segs: Sequence[torch.Tensor], me: int, order: Sequence[int],
                     owner: Callable[[int], int], chunk_bytes: int, phase: int = 1) -> None:
    """In place: position k starts with segs[owner(k)] and ends with all of them."""
    p, k = len(order), order.index(me)
    nxt, prv = order[(k + 1) % p], order[(k - 1) % p]
    sends = []
    for s in range(p - 1):
        out, inc = segs[owner((k - s) % p)], segs[owner((k - 1 - s) % p)]
        recvs = [p2p.irecv(x, prv, p2p.tag(phase, s, i)) for i, x in enumerate(_pieces(inc, chunk_bytes))]
        sends += [p2p.isend(x, nxt, p2p.tag(phase, s, i)) for i, x in enumerate(_pieces(out, chunk_bytes))]
        _wait_all(recvs)
    _wait_all(sends)


def ring_all_reduce(p2p: P2P, t: torch.Tensor, *, order: Sequence[int], chunk_bytes: int = CHUNK_BYTES,
                    phase: int = 0) -> None:
    """Sum `t` over the ranks in `order` (a permutation of all ranks), in place: reduce-scatter + all-gather."""
    flat = t.view(-1)
    segs = _segments(flat, len(order))
    me = p2p.pg.rank()
    _ring_reduce_scatter(p2p, segs, me, order, lambda k: k, chunk_bytes, phase)
    _ring_all_gather(p2p, segs, me, order, lambda k: k, chunk_bytes, phase + 1)


def ring_reduce_scatter(p2p: P2P, output: torch.Tensor, inputs: Sequence[torch.Tensor], *, order: Sequence[int],
                        chunk_bytes: int = CHUNK_BYTES) -> None:
    """output = sum over ranks of inputs[my rank]; inputs[r] is the part rank r receives (not modified)."""
    segs = [x.detach().reshape(-1).clone() for x in inputs]
    _ring_reduce_scatter(p2p, segs, p2p.pg.rank(), order, lambda k: order[k], chunk_bytes)
    output.view(-1).copy_(segs[p2p.pg.rank()])


def ring_all_gather(p2p: P2P, outputs: Sequence[torch.Tensor], input: torch.Tensor, *, order: Sequence[int],
                    chunk_bytes: int = CHUNK_BYTES) -> None:
    """outputs[r] = rank r's input, for every rank r. The outputs must be contiguous (views of one tensor are)."""
    me = p2p.pg.rank()
    segs = [o.view(-1) for o in outputs]
    segs[me].copy_(input.reshape(-1))
    _ring_all_gather(p2p, segs, me, order, lambda k: order[k], chunk_bytes)


# -- trees ----------------------------------------------------------------------------------------------------

def tree_links(kind: str, p: int) -> tuple[list[int | None], list[list[int]]]:
    """Parent and children of each position 0..p-1 (0 is the root) of a binomial or binary tree."""
    if kind == "binary":
        parent = [None] + [(v - 1) // 2 for v in range(1, p)]
    elif kind == "binomial":
        parent = [None] + [v - (v & -v) for v in range(1, p)]
    else:
        raise ValueError(f"tree kind {kind!r}")
    children: list[list[int]] = [[] for _ in range(p)]
    for v in range(1, p):
        above = parent[v]
        assert above is not None  # only the root (position 0) has none
        children[above].append(v)
    return parent, children


def tree_all_reduce(p2p: P2P, t: torch.Tensor, *, root: int, kind: str = "binary", order: Sequence[int] | None = None,
                    chunk_bytes: int = CHUNK_BYTES, reduce_only: bool = False, broadcast_only: bool = False) -> None:
    """Sum `t` up a tree to `root`, then broadcast it down, chunk by chunk (chunk c goes down while c+1 goes up).
    Positions are taken in `order` starting from the root. reduce_only: only the root ends with the sum;
    broadcast_only: every rank ends with the root's `t`."""
    p = p2p.pg.size()
    order = list(order) if order is not None else list(range(p))
    pos = order.index(root)
    ranks = order[pos:] + order[:pos]  # position v -> rank
    me = ranks.index(p2p.pg.rank())
    parent, children = tree_links(kind, p)
    above = parent[me]
    up = None if above is None else ranks[above]
    downs = [ranks[c] for c in children[me]]
    pieces = _pieces(t.view(-1), chunk_bytes)
    n = len(pieces)
    child_bufs = [] if broadcast_only else [[torch.empty_like(x) for x in pieces] for _ in downs]
    child_recvs = [[p2p.irecv(b, c, p2p.tag(0, 0, i)) for i, b in enumerate(bufs)] for c, bufs in zip(downs, child_bufs)]
    up_sends: list[_Send] = []
    down_sends: list[_Send] = []
    bcast_recvs: dict[int, _Recv] = {}

    def reduce_piece(c: int) -> None:
        for recvs, bufs in zip(child_recvs, child_bufs):
            recvs[c].wait()
            pieces[c].add_(bufs[c])
        if up is not None:
            up_sends.append(p2p.isend(pieces[c], up, p2p.tag(0, 0, c)))

    def bcast_piece(c: int) -> None:
        if up is not None:
            if c not in bcast_recvs:
                if up_sends:
                    up_sends[c].wait()  # the piece's partial sum must be out before the result lands on it
                bcast_recvs[c] = p2p.irecv(pieces[c], up, p2p.tag(1, 0, c))
            bcast_recvs.pop(c).wait()
        down_sends.extend(p2p.isend(pieces[c], d, p2p.tag(1, 0, c)) for d in downs)

    if reduce_only:
        for c in range(n):
            reduce_piece(c)
    elif broadcast_only:
        if up is not None:
            bcast_recvs.update({c: p2p.irecv(x, up, p2p.tag(1, 0, c)) for c, x in enumerate(pieces)})
        for c in range(n):
            bcast_piece(c)
    else:
        # piece c goes up while piece c-1 comes down; the parent sends c-1 down only after c arrived from us
        for c in range(n):
            reduce_piece(c)
            if c:
                bcast_piece(c - 1)
        bcast_piece(n - 1)
    _wait_all(up_sends)
    _wait_all(down_sends)


def tree_reduce(p2p: P2P, t: torch.Tensor, *, root: int, kind: str = "binary", order=None,
                chunk_bytes: int = CHUNK_BYTES) -> None:
    """Sum `t` into `root`'s copy (the others' copies hold partial sums afterwards)."""
    tree_all_reduce(p2p, t, root=root, kind=kind, order=order, chunk_bytes=chunk_bytes, reduce_only=True)


def tree_broadcast(p2p: P2P, t: torch.Tensor, *, root: int, kind: str = "binary", order=None,
                   chunk_bytes: int = CHUNK_BYTES) -> None:
    tree_all_reduce(p2p, t, root=root, kind=kind, order=order, chunk_bytes=chunk_bytes, broadcast_only=True)


# -- hierarchical ---------------------------------------------------------------------------------------------

def hierarchical_all_reduce(p2p: P2P, t: torch.Tensor, *, groups: Sequence[Sequence[int]],
                            leader_all_reduce: Callable[[torch.Tensor], None] | None = None,
                            back: dict[int, int] | None = None, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Sum `t` over every rank: each group's members stream their pieces to the group's leader (its first rank),
    the leaders all-reduce each piece among themselves (a ring over p2p unless `leader_all_reduce` is given:
    e.g. the native op of a group of the leaders), and stream the result back. A member's link carries the
    tensor once each way, which is what makes a congested host a leaf. `back` names, per member, another leader
    that sends it the result: with gloo, one connection carrying both ways runs at about half duplex, so the
    result comes back on a different one."""
    back = back or {}
    me = p2p.pg.rank()
    group = next(g for g in groups if me in g)
    leader = group[0]
    pieces = _pieces(t.view(-1), chunk_bytes)
    if me != leader:
        sends = [p2p.isend(x, leader, p2p.tag(0, 0, c)) for c, x in enumerate(pieces)]
        results = []
        for c, (s, x) in enumerate(zip(sends, pieces)):
            s.wait()  # the piece is out: its result may land on it
            results.append(p2p.irecv(x, back.get(me, leader), p2p.tag(1, 0, c)))
        _wait_all(results)
        return
    members = list(group[1:])
    leaders = [g[0] for g in groups]
    served = [m for g in groups for m in g[1:] if back.get(m, g[0]) == me]
    bufs = [[torch.empty_like(x) for x in pieces] for _ in members]
    recvs = [[p2p.irecv(b, m, p2p.tag(0, 0, c)) for c, b in enumerate(mb)] for m, mb in zip(members, bufs)]
    sends = []
    for c, x in enumerate(pieces):
        for mr, mb in zip(recvs, bufs):
            mr[c].wait()
            x.add_(mb[c])
        if len(leaders) > 1:
            if leader_all_reduce is not None:
                leader_all_reduce(x)
            else:
                # phases 2..15 (pairs), reused in turn: gloo matches one tag's messages in order per peer
                ring_all_reduce(p2p, x, order=leaders, chunk_bytes=chunk_bytes, phase=2 + 2 * (c % 7))
        sends += [p2p.isend(x, m, p2p.tag(1, 0, c)) for m in served]
    _wait_all(sends)
