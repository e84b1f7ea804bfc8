"""Who holds which parity of every rank's `local_state()`, when it is current, and how lost ranks are rebuilt
from it: `ParityKeeper`, one per rank, on process groups of its own (the seam's, uncounted as strategy traffic).

Each rank keeps two *slots*. A slot holds, for one step boundary T (T = optimizer updates applied), the rank's
state bytes at T laid out as tier 1's rows (`erasure.XorLayout`: the send buffer of the exchange, and the undo
copy), its tier-1 stripe and its tier-2 shards of T. A slot is *usable* for T when both its data and its parity
are of T. `protect(T)` fills the slot that is not current, in a background thread: copy the live state into it,
one reduce-scatter (BXOR) in the parity group, one all-to-all + Reed-Solomon encode in the column (tier 2), then a
vote (an all-reduce over every rank); only when the vote completes without a failure does that slot become
current. The trainer calls `wait_current()` before the next optimizer update, so the update never starts before
its step boundary is protected, and never overwrites the only usable copy.

Commit rule (what survivors agree on). After a failure, every rank reports its usable steps; the rebuild step is
T = max of the steps usable on every survivor. It always exists: if no survivor saw the vote of n+1 complete,
nobody's current slot moved past n, and every rank kept n usable (the slot being filled is the other one); if
some survivor saw it complete, every rank entered that vote after finishing its exchange of n+1, so n+1 is usable
everywhere. Every rank then writes the bytes of T back into its live tensors (a half-done update is rolled back),
the lost ranks' bytes are decoded into theirs, and parity is rebuilt by `protect(T)`. Cost: the undo copy is one
local state per slot (2 x state + 2 x parity per rank in all); a second failure before that `protect(T)` completes
is not recoverable (the replacements hold no parity yet).

Call sequence. Every rank (a replacement too, while Seam.joining) builds the keeper right after its engine
(`build_keeper`); `protect(start_step)` before the loop. Each step: forward and backward, `wait_current()` (False:
a peer failed, do not update), the optimizer update, `protect(step + 1)`. After a failure: `settle()`,
`Seam.reconfigure(g + 1)`, then `recover(lost)` on every rank; training resumes at the report's `step`.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from dtk.comm.group import Seam
from dtk.recipe import parity_layout
from dtk.resilience.erasure import RSLayout, XorLayout

log = logging.getLogger(__name__)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ParityLost(RuntimeError):
    """The lost ranks cannot be rebuilt from the parity that survives (too many lost, or no common step)."""


@dataclass
class RebuildReport:
    step: int
    """The step boundary every rank is at after the rebuild (updates applied): the trainer resumes there."""
    tier: int
    """1: XOR inside the parity groups; 2: Reed-Solomon across groups; 0: nothing was lost (a rollback only)."""
    lost: list[int]
    bytes_decoded: int
    """Local-state bytes rebuilt, over all lost ranks."""
    seconds: float
    """From the call until every rank's live tensors hold step T (parity is rebuilt afterwards, in background)."""


def agree_step(usable: dict[int, list[int]], *, lost: set[int]) -> int:
    """The commit rule: the newest step boundary usable (data and parity of that step) on every survivor, given
    each survivor's usable steps (-1 = a slot with none). Raises ParityLost when there is none."""
    common = None
    for steps in usable.values():
        mine = {s for s in steps if s >= 0}
        common = mine if common is None else common & mine
    if not common:
        raise ParityLost(f"no step boundary is protected on every survivor (usable steps per rank: {usable}); "
                         f"lost ranks {sorted(lost)} cannot be rebuilt")
    return max(common)


class FlatState:
    """A list of live tensors seen as one flat byte string (each tensor's bytes through a uint8 view)."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.views = []
        for i, t in enumerate(tensors):
            if not t.is_contiguous():
                raise ValueError(f"local_state()[{i}] is not contiguous; its bytes cannot be written back in place")
            self.views.append(t.detach().reshape(-1).view(torch.uint8))
        self.nbytes = sum(v.numel() for v in self.views)

    def read_into(self, dst: torch.Tensor, start: int) -> None:
        """dst <- flat bytes [start, start + len(dst)), zeros past the end of the state."""
        self._walk(dst, start, lambda view, part: part.copy_(view))
        tail = max(0, self.nbytes - start)
        if tail < dst.numel():
            dst[tail:].zero_()

    def write_from(self, src: torch.Tensor, start: int) -> None:
        """Flat bytes [start, start + len(src)) <- src (bytes past the end of the state are ignored)."""
        with torch.no_grad():
            self._walk(src, start, lambda view, part: view.copy_(part))

    def _walk(self, buf: torch.Tensor, start: int, op) -> None:
        stop, offset = start + buf.numel(), 0
        for v in self.views:
            lo, hi = max(start, offset), min(stop, offset + v.numel())
            if lo < hi:
                op(v[lo - offset:hi - offset], buf[lo - start:hi - start])
            offset += v.numel()


@dataclass
class Slot:
    rows: np.ndarray
    parity1: np.ndarray
    parity2: np.ndarray
    data_step: int = -1
    parity_step: int = -1

    @property
    def usable(self) -> int:
        return self.data_step if self.data_step == self.parity_step else -1


@dataclass
class ExchangeStats:
    """What one protect() cost this rank: seconds per phase and bytes it put on the wire (ring bus factors)."""

    step: int = -1
    fill_s: float = 0.0
    tier1_s: float = 0.0
    tier2_s: float = 0.0
    encode_s: float = 0.0
    vote_s: float = 0.0
    seconds: float = 0.0
    bytes: float = 0.0
    totals: dict = field(default_factory=lambda: {"protects": 0, "seconds": 0.0, "bytes": 0.0, "encode_s": 0.0,
                                                  "stall_s": 0.0})
    """stall_s: what the trainer waited for a protect to finish before an update (the part not overlapped with
    forward and backward)."""


class ParityKeeper:
    """Tier-1 XOR parity inside groups of `group_size` consecutive ranks, tier-2 Reed-Solomon with `tier2` parity
    shards across groups (0 = off), of the tensors `state()` returns; built on every rank in the same order (a
    replacement too), after the default process group (the seam) exists."""

    def __init__(self, *, state: Callable[[], list[torch.Tensor]], group_size: int, tier2: int = 0,
                 ec_type: str | None = None):
        self.state_fn, self.ec_type = state, ec_type
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if group_size < 2 or self.world % group_size:
            raise ValueError(f"parity groups of {group_size} ranks do not tile a world of {self.world} "
                             f"(need at least 2 ranks per group, dividing the world)")
        self.k, self.groups = group_size, self.world // group_size
        if tier2 and not 1 <= tier2 < self.groups:
            raise ValueError(f"tier 2 with {tier2} parity shards needs at least {tier2 + 1} parity groups; "
                             f"{self.world} ranks in groups of {group_size} make {self.groups}")
        self.m = tier2
        self.group_index, self.member = divmod(self.rank, self.k)
        # Every rank creates every group, in this order (new_group's rule); each keeps those it belongs to.
        self.world_group = dist.new_group(backend="dtk")
        self.tier1_group = self.column_group = None
        for g in range(self.groups):
            pg = dist.new_group(ranks=list(range(g * self.k, (g + 1) * self.k)), backend="dtk")
            if g == self.group_index:
                self.tier1_group = pg
        if self.m:
            for i in range(self.k):
                pg = dist.new_group(ranks=[g * self.k + i for g in range(self.groups)], backend="dtk")
                if i == self.member:
                    self.column_group = pg
        self.xor: XorLayout | None = None
        self.rs: RSLayout | None = None
        self.codec = None
        self.sizes: list[int] = []
        self.slots: list[Slot] = []
        self.current = 0
        self.stats = ExchangeStats()
        self._thread: threading.Thread | None = None
        self._result: bool | BaseException = True

    # -- sizes --
    @property
    def state_bytes(self) -> int:
        return FlatState(self.state_fn()).nbytes

    @property
    def parity_bytes_per_rank(self) -> int:
        """Parity of one protected step held by this rank: C1 (tier 1) + m x C2 (tier 2)."""
        return 0 if self.xor is None else self.xor.chunk + (self.rs.chunk * self.m if self.rs else 0)

    @property
    def memory_bytes(self) -> int:
        """Everything the keeper holds: two slots of rows (the undo copies) and parity."""
        return sum(s.rows.nbytes + s.parity1.nbytes + s.parity2.nbytes for s in self.slots)

    def figures(self) -> dict:
        """For summary.json's `resilience` section."""
        return {"parity_bytes_per_rank": self.parity_bytes_per_rank, "local_state_bytes": self.state_bytes,
                "parity_memory_bytes_per_rank": self.memory_bytes, "parity_group": self.k,
                "parity_tier2": self.m, "ec_type": self.codec.ec_type if self.codec else None,
                "exchange": {k: v for k, v in vars(self.stats).items()}}

    def _set_layout(self, sizes: list[int]) -> None:
        if sizes == self.sizes and self.slots:
            return
        if self.slots and any(s.usable >= 0 for s in self.slots):
            raise ParityLost(f"local state sizes changed from {self.sizes} to {sizes} bytes; the parity held "
                             f"does not fit them")
        self.sizes, b = sizes, max(sizes)
        self.xor = XorLayout.for_state(k=self.k, state_bytes=b)
        if self.m:
            self.rs = RSLayout.for_state(groups=self.groups, m=self.m, state_bytes=b)
            self.codec = self.rs.codec(self.ec_type)
        c2 = self.rs.chunk * self.m if self.rs else 0
        self.slots = [Slot(rows=np.zeros((self.k, self.xor.chunk), dtype=np.uint8),
                           parity1=np.zeros(self.xor.chunk, dtype=np.uint8),
                           parity2=np.zeros(c2, dtype=np.uint8)) for _ in range(2)]
        self.current = 0

    def _all_gather(self, values: list[int]) -> np.ndarray:
        mine = torch.tensor(values, dtype=torch.int64)
        out = torch.zeros(self.world * len(values), dtype=torch.int64)
        _all_gather_single(out, mine, group=self.world_group)
        return out.view(self.world, len(values)).numpy()

    @staticmethod
    def _failed(generation: int) -> bool:
        return Seam.failed_generation >= generation or Seam.generation != generation

    # -- keeping parity current --
    def protect(self, step: int) -> None:
        """Start building the parity of the state at boundary `step` (updates applied) in a background thread.
        Call on every rank after a committed update (and once at the start), never while an update runs."""
        self.settle()
        self._result = False
        generation = Seam.generation
        flat = FlatState(self.state_fn())  # here, not in the thread: local_state() may create optimizer state
        self._thread = threading.Thread(target=self._run_protect, args=(step, generation, flat), daemon=True,
                                        name=f"dtk-parity-{step}")
        self._thread.start()

    def wait_current(self) -> bool:
        """Block until the last protect() is over; True if its step is protected (the update may start), False if a
        peer failed meanwhile (the seam has flagged it: do not update, recover)."""
        t0 = time.perf_counter()
        self.settle()
        self.stats.totals["stall_s"] += time.perf_counter() - t0
        if isinstance(self._result, BaseException):
            raise self._result
        return self._result

    def settle(self) -> None:
        """Join the background thread (after a failure its collectives are released, so this returns promptly).
        Call before Seam.reconfigure()."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run_protect(self, step: int, generation: int, flat: FlatState) -> None:
        try:
            with Seam.uncounted():
                self._result = self._protect(step, generation, flat)
        except BaseException as e:  # a bug: hand it to the trainer's thread with its traceback
            self._result = e

    def _protect(self, step: int, generation: int, flat: FlatState) -> bool:
        st, t0 = self.stats, time.perf_counter()
        if not self.slots:
            self._set_layout([int(v) for v in self._all_gather([flat.nbytes])[:, 0]])
            if self._failed(generation):
                return False
        if flat.nbytes != self.sizes[self.rank]:
            raise RuntimeError(f"local_state() changed from {self.sizes[self.rank]} to {flat.nbytes} bytes between "
                               f"step boundaries; parity needs its layout fixed for the whole run")
        slot = self.slots[1 - self.current]
        slot.data_step = slot.parity_step = -1
        self._fill_rows(slot, flat)
        slot.data_step = step
        t1 = time.perf_counter()
        _reduce_scatter_single(torch.from_numpy(slot.parity1), torch.from_numpy(slot.rows).view(-1),
                               op=dist.ReduceOp.BXOR, group=self.tier1_group)
        wire = slot.rows.nbytes * (self.k - 1) / self.k
        t2 = time.perf_counter()
        if self._failed(generation):
            return False
        encode_s = 0.0
        if self.m:
            sent, encode_s = self._tier2_exchange(slot)
            wire += sent
            if self._failed(generation):
                return False
        t3 = time.perf_counter()
        slot.parity_step = step
        vote = torch.ones(1, dtype=torch.int64)
        dist.all_reduce(vote, group=self.world_group)
        if self._failed(generation) or int(vote) != self.world:
            return False
        self.current = 1 - self.current
        t4 = time.perf_counter()
        st.step, st.fill_s, st.tier1_s, st.tier2_s, st.encode_s, st.vote_s = (step, t1 - t0, t2 - t1, t3 - t2,
                                                                              encode_s, t4 - t3)
        st.seconds, st.bytes = t4 - t0, wire
        st.totals["protects"] += 1
        st.totals["seconds"] += st.seconds
        st.totals["bytes"] += wire
        st.totals["encode_s"] += encode_s
        return True

    def _fill_rows(self, slot: Slot, flat: FlatState) -> None:
        body = torch.from_numpy(slot.rows).view(-1)
        c, cut = self.xor.chunk, self.member * self.xor.chunk
        flat.read_into(body[:cut], 0)
        body[cut:cut + c].zero_()
        flat.read_into(body[cut + c:], cut)

    def _restore(self, slot: Slot) -> None:
        """Live tensors <- the slot's bytes (a rollback on a survivor, the rebuilt state on a replacement)."""
        flat, body = FlatState(self.state_fn()), torch.from_numpy(slot.rows).view(-1)
        c, cut = self.xor.chunk, self.member * self.xor.chunk
        flat.write_from(body[:cut], 0)
        flat.write_from(body[cut + c:], cut)

    def _flat(self, slot: Slot) -> np.ndarray:
        return self.xor.flat(slot.rows, self.member)

    def _tier2_exchange(self, slot: Slot) -> tuple[float, float]:
        """Send my data chunks to the holders of their stripes; encode the stripes I hold. Returns (bytes, s)."""
        rs, me, flat = self.rs, self.group_index, self._flat(slot)
        send = [[rs.chunk_of(flat, me, s) for s, _ in rs.held(h) if me in rs.data_members(s)] if h != me else []
                for h in range(self.groups)]
        recv_from = [[s for s, _ in rs.held(me) if j in rs.data_members(s)] if j != me else []
                     for j in range(self.groups)]
        received = self._all_to_all(send, [len(r) for r in recv_from])
        got = {(s, j): received[j][n] for j in range(self.groups) for n, s in enumerate(recv_from[j])}
        t0 = time.perf_counter()
        for q, (s, p) in enumerate(rs.held(me)):
            shards = self.codec.encode([got[(s, j)] for j in rs.data_members(s)])
            slot.parity2[q * rs.chunk:(q + 1) * rs.chunk] = shards[p]
        return float(sum(len(x) for x in send) * rs.chunk), time.perf_counter() - t0

    def _all_to_all(self, send: list[list[np.ndarray]], recv_counts: list[int]) -> list[list[np.ndarray]]:
        """Chunks of C2 bytes to each column member; returns the chunks received from each, in order."""
        c = self.rs.chunk
        inp = torch.from_numpy(np.concatenate([x for chunks in send for x in chunks]) if any(send)
                               else np.zeros(0, dtype=np.uint8))
        out = torch.zeros(sum(recv_counts) * c, dtype=torch.uint8)
        dist.all_to_all_single(out, inp, [n * c for n in recv_counts], [len(x) * c for x in send],
                               group=self.column_group)
        arr, got, offset = out.numpy(), [], 0
        for n in recv_counts:
            got.append([arr[offset + i * c:offset + (i + 1) * c] for i in range(n)])
            offset += n * c
        return got

    # -- recovery --
    def recover(self, lost: list[int]) -> RebuildReport:
        """Run collectively by every rank (survivors and replacements, the ranks in `lost`) once the groups are
        rebuilt (Seam.reconfigure): agree on the step T, roll every survivor back to T, decode the lost ranks'
        bytes of T into their live tensors, and start protect(T). Also repairs a corrupt rank in place (list it in
        `lost`: its own bytes and parity are not used). Raises ParityLost when the parity left cannot do it."""
        self.settle()
        t0 = time.perf_counter()
        generation = Seam.generation
        lost_set = set(lost)
        is_lost = self.rank in lost_set
        mine = [self.state_bytes] + ([-1, -1] if is_lost or not self.slots else [s.usable for s in self.slots])
        with Seam.uncounted():
            table = self._all_gather(mine)
            self._check(generation, "agreeing on the step")
            self._set_layout([int(v) for v in table[:, 0]])
            step = agree_step({r: [int(v) for v in table[r, 1:]] for r in range(self.world) if r not in lost_set},
                              lost=lost_set)
            if is_lost:
                slot = self.slots[self.current]
                slot.data_step = slot.parity_step = -1
            else:
                self.current = next(i for i, s in enumerate(self.slots) if s.usable == step)
                slot = self.slots[self.current]
            tier = self._plan_tier(lost_set)
            if tier == 1:
                self._rebuild_tier1(slot, lost_set)
            elif tier == 2:
                self._rebuild_tier2(slot, lost_set)
            self._check(generation, f"rebuilding from tier {tier}")
            if is_lost:
                slot.data_step = step
            self._restore(slot)
        report = RebuildReport(step=step, tier=tier, lost=sorted(lost_set),
                               bytes_decoded=sum(self.sizes[r] for r in lost_set), seconds=time.perf_counter() - t0)
        log.info("rebuilt rank(s) %s from tier %d at step %d: %d bytes in %.3fs", report.lost, tier, step,
                 report.bytes_decoded, report.seconds)
        self.protect(step)
        return report

    def _check(self, generation: int, what: str) -> None:
        if self._failed(generation):
            raise ParityLost(f"a rank failed while {what}: {Seam.failure or 'collectives released'}")

    def _plan_tier(self, lost: set[int]) -> int:
        if not lost:
            return 0
        per_group = [sum(1 for r in lost if r // self.k == g) for g in range(self.groups)]
        if max(per_group) <= 1:
            return 1
        if not self.m:
            raise ParityLost(f"{max(per_group)} ranks of one parity group lost ({sorted(lost)}); tier 1 rebuilds "
                             f"one per group, and tier 2 is off (resilience.parity_tier2: 0)")
        per_column = [sum(1 for r in lost if r % self.k == i) for i in range(self.k)]
        if max(per_column) > self.m:
            raise ParityLost(f"ranks {sorted(lost)} lose {max(per_column)} groups' members at one position; "
                             f"tier 2 survives at most resilience.parity_tier2 = {self.m}")
        return 2

    def _rebuild_tier1(self, slot: Slot, lost: set[int]) -> None:
        """One XOR-reduce to the lost member of my group (if it lost one); survivors send their chunks and stripe."""
        mine = [r for r in lost if r // self.k == self.group_index]
        if not mine:
            return
        target = mine[0]
        if self.rank == target:
            buf = np.zeros_like(slot.rows)
        else:
            buf = self.xor.contribution(member=self.member, lost=target % self.k, rows=slot.rows,
                                        parity=slot.parity1)
        t = torch.from_numpy(buf)
        dist.reduce(t.view(-1), dst=target, op=dist.ReduceOp.BXOR, group=self.tier1_group)
        if self.rank == target:
            slot.rows[:] = buf

    def _rebuild_tier2(self, slot: Slot, lost: set[int]) -> None:
        """In my column: every needed survivor sends each lost member its shard of that member's data stripes."""
        rs, me = self.rs, self.group_index
        column_lost = {r // self.k for r in lost if r % self.k == self.member}
        if not column_lost:
            return
        flat = None if me in column_lost else self._flat(slot)
        send, recv_from = [], []
        for d in range(self.groups):
            if me in column_lost or d not in column_lost:
                send.append([])
            else:
                send.append([rs.shard_of(member=me, stripe=s, flat=flat, parity=slot.parity2)
                             for s in rs.data_stripes(d) if me in rs.sources(s, column_lost)])
        for j in range(self.groups):
            recv_from.append([s for s in rs.data_stripes(me) if j in rs.sources(s, column_lost)]
                             if me in column_lost and j not in column_lost else [])
        received = self._all_to_all(send, [len(r) for r in recv_from])
        if me in column_lost:
            shards: dict[int, dict[int, np.ndarray]] = {}
            for j in range(self.groups):
                for n, s in enumerate(recv_from[j]):
                    shards.setdefault(s, {})[rs.shard_index(s, j)] = received[j][n]
            slot.rows[:] = self.xor.rows(rs.rebuild(me, shards, self.codec)[:self.xor.padded_bytes], self.member)

    # -- corruption --
    def mismatched_bytes(self) -> int:
        """Bytes of the live state that differ from the current slot (between protect and the next update they
        must be equal: a difference is a bit flip). Local, no collective."""
        slot = self.slots[self.current] if self.slots else None
        if slot is None or slot.data_step < 0:
            return 0
        live = torch.zeros(self.xor.padded_bytes, dtype=torch.uint8)
        FlatState(self.state_fn()).read_into(live, 0)
        return int(np.count_nonzero(self._flat(slot) != live.numpy()))


def build_keeper(*, state: Callable[[], list[torch.Tensor]], resilience, nproc_per_node: int) -> ParityKeeper:
    """The keeper a recipe asks for, on every rank (a replacement too), after the default group exists."""
    k, m = parity_layout(resilience, world=dist.get_world_size(), nproc_per_node=nproc_per_node)
    return ParityKeeper(state=state, group_size=k, tier2=m)
