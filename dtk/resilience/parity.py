"""Who holds which parity of every rank's protected state, when it is current, and how lost ranks are rebuilt from
it: `ParityKeeper`, one per rank, on process groups of its own (the seam's, uncounted as strategy traffic).

What is protected is what no peer can rebuild: the engine's `protected_state()` (ZeRO leaves out its low-precision
parameters, which the all-gather of the master partitions, or a local cast, makes again: `rebuild_replicated()`).

One staging buffer per rank, `rows`: tier 1's k x C send buffer (`erasure.XorLayout`) of the state at the protected
step boundary T (updates applied), whose own row, a hole in the layout, holds this rank's tier-1 stripe of T; beside
it the tier-2 shards of T. So the memory held is one copy of the state plus its parity: (k/(k-1)) x the state, 1.5x
for k = 3. `protect(T')` runs in a background thread while the live tensors hold T' (the trainer starts no update
until `wait_current()`): XOR the live state into the rows, which then hold the delta T xor T' (and T = rows xor live);
one reduce-scatter (BXOR) of the rows into a fresh C-byte buffer gives stripe(T) xor stripe(delta) = stripe(T'), the
hole being the old stripe; tier 2 sends delta chunks and adds their Reed-Solomon parity (a linear code) to the old
shards; then a vote (an all-gather over every rank); when it completes, copy the live state into the rows (T') and
move the fresh stripe into the hole. One XOR and one copy of the state per protection, no other. The fresh buffers (C + m x C2 bytes) exist only while an exchange runs.

Commit rule (what survivors agree on). After a failure, every rank reports its usable steps: T (always, from the
rows, xor the live state while a delta is held) and T' if its own exchange of T' completed. The rebuild step is the
max of the steps usable on every survivor. It always exists: every rank keeps T until it has seen the vote of T'
complete, and a rank sees that only once every rank has entered the vote, that is, finished its exchange of T', so
T' is then usable everywhere. Every rank then writes the bytes of that step back into its live tensors (the updates
since, and a half-done one, are rolled back), the lost ranks' state rows are rebuilt (one XOR-reduce of the
survivors' rows), and the engine rebuilds its replicated state; the lost ranks' stripes (parity of the others) follow
in the background while training resumes, done before the next update. Nothing is protected again before the next
step: the rebuilt rows are the lost rank's rows. A second failure before a replacement's rows are rebuilt, its stripe
included, is not recoverable (it holds no parity yet).

Call sequence. Every rank (a replacement too, while Seam.joining) builds the keeper right after its engine
(`build_keeper`); `protect(start_step)` before the loop. Each step: forward and backward, `wait_current()` (False:
a peer failed, do not update), the optimizer update, and `protect(step + 1)` when `due(step + 1)` (every
`resilience.protect_every` steps: a rollback redoes at most that many). After a failure: `settle()`,
`Seam.reconfigure(g + 1)`, then `recover(lost)` on every rank; training resumes at the report's `step`, and the next
boundary that protects nothing calls `catch_up()` (the rebuilt ranks' stripes, in the background).
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
from dtk.resilience.reduced import ReducedGrads
from dtk.resilience.schedule import DEFAULT_MTBF_S, ProtectSchedule
from dtk.resilience.staging import FlatState

log = logging.getLogger(__name__)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
PIECE = 8 << 20
"""Bytes per XOR-reduce of a rebuild: gloo's reduce overwrites its input on the senders, so each sends a copy of one
piece of its rows at a time, not of all of them."""


class ParityLost(RuntimeError):
    """The lost ranks cannot be rebuilt from the parity that survives (too many lost, or no common step)."""


@dataclass
class RebuildReport:
    step: int
    """The step boundary every rank is at after the rebuild (updates applied): the trainer resumes there."""
    rolled_forward: bool = False
    """The lost rank was rebuilt at step - 1 and made that step's update itself (resilience.roll_forward); the
    survivors kept theirs."""
    tier: int = 0
    """1: XOR inside the parity groups; 2: Reed-Solomon across groups; 0: nothing was lost (a rollback only)."""
    lost: list[int] = field(default_factory=list)
    bytes_decoded: int = 0
    """Protected-state bytes rebuilt, over all lost ranks (and the reduced gradients of a roll forward)."""
    seconds: float = 0.0
    """From the call until every rank's live tensors hold step T (the lost ranks' stripes follow in the background)."""


def agree_step(usable: dict[int, list[int]], *, lost: set[int]) -> int:
    """The commit rule: the newest step boundary usable (data and parity of that step) on every survivor, given
    each survivor's usable steps (-1 = none). Raises ParityLost when there is none."""
    common = None
    for steps in usable.values():
        mine = {s for s in steps if s >= 0}
        common = mine if common is None else common & mine
    if not common:
        raise ParityLost(f"no step boundary is protected on every survivor (usable steps per rank: {usable}); "
                         f"lost ranks {sorted(lost)} cannot be rebuilt")
    return max(common)


@dataclass
class ExchangeStats:
    """What one protect() cost this rank: seconds per phase and bytes it put on the wire (ring bus factors)."""

    step: int = -1
    fill_s: float = 0.0
    """The XOR of the live state into the staging rows (the delta)."""
    tier1_s: float = 0.0
    tier2_s: float = 0.0
    encode_s: float = 0.0
    vote_s: float = 0.0
    commit_s: float = 0.0
    """The copy of the live state into the rows (they hold the new step) and the stripe moved into its place."""
    seconds: float = 0.0
    cpu_s: float = 0.0
    """CPU seconds of the protecting thread (its XORs and encodes; gloo's own threads not included)."""
    bytes: float = 0.0
    totals: dict = field(default_factory=lambda: {"protects": 0, "seconds": 0.0, "cpu_s": 0.0, "bytes": 0.0,
                                                  "encode_s": 0.0, "stall_s": 0.0})
    """stall_s: what the trainer waited for a protect to finish before an update (the part not overlapped with
    forward and backward)."""


class ParityKeeper:
    """Tier-1 XOR parity inside groups of `group_size` consecutive ranks, tier-2 Reed-Solomon with `tier2` parity
    shards across groups (0 = off), of the tensors `state()` returns; built on every rank in the same order (a
    replacement too), after the default process group (the seam) exists. `rebuild()` (collective) makes the
    engine's unprotected, replicated state again from the protected one; `local_state()` is the engine's whole
    local state, for the figures."""

    def __init__(self, *, state: Callable[[], list[torch.Tensor]], group_size: int, tier2: int = 0,
                 ec_type: str | None = None, rebuild: Callable[[], None] | None = None,
                 local_state: Callable[[], list[torch.Tensor]] | None = None, schedule: ProtectSchedule | None = None):
        self.state_fn, self.ec_type = state, ec_type
        self.rebuild_fn, self.local_fn = rebuild, local_state or state
        self.schedule = schedule or ProtectSchedule(every=1, mtbf_s=DEFAULT_MTBF_S)
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
        self.forget()
        self.stats = ExchangeStats()
        self._thread: threading.Thread | None = None
        self._result: bool | BaseException = True
        self.reduced: ReducedGrads | None = None
        """resilience.roll_forward: the last step's reduced gradients (the seam fills it)."""
        self.roll_forward_fn: Callable[[int, list[tuple[int, torch.Tensor]]], None] | None = None
        """(step, [(engine key, reduced bytes)]): on the lost rank, set the gradients and make the step's update."""
        self._stripes: set[int] | None = None
        """The ranks the last rebuild gave their state but not yet their stripes, which catch_up() or protect()
        sends."""
        self.rolled_to = -1
        """The boundary the last recovery rolled every rank forward to (-1: it did not): no rank did its work (the
        trainer does it before the next step)."""

    def forget(self) -> None:
        """Hold nothing (a fresh replacement's keeper): no layout, no protected step."""
        self.rows: np.ndarray | None = None
        """k x C: the protected step's bytes in tier 1's layout, this rank's stripe in its own row."""
        self.parity2 = np.zeros(0, dtype=np.uint8)
        self.base = -1
        """The step boundary `rows` and the parity hold (-1: none yet)."""
        self.delta_to = -1
        """While an exchange runs (or after one a failure cut short): the rows hold base xor this step."""
        self.fresh1: np.ndarray | None = None
        self.fresh2: np.ndarray | None = None
        self.fresh_step = -1
        """The step whose parity the fresh buffers hold whole (this rank's exchange of it completed)."""

    # -- sizes --
    @property
    def state_bytes(self) -> int:
        return FlatState(self.state_fn()).nbytes

    @property
    def protected(self) -> bool:
        return self.base >= 0

    @property
    def parity_bytes_per_rank(self) -> int:
        """Parity of one protected step held by this rank: C1 (tier 1) + m x C2 (tier 2)."""
        return 0 if self.xor is None else self.xor.chunk + (self.rs.chunk * self.m if self.rs else 0)

    @property
    def memory_bytes(self) -> int:
        """What the keeper holds between exchanges: the staging rows (state and stripe) and the tier-2 shards, and
        the last step's reduced gradients for a roll forward."""
        reduced = self.reduced.nbytes if self.reduced is not None else 0
        return reduced + (0 if self.rows is None else self.rows.nbytes + self.parity2.nbytes)

    @property
    def peak_memory_bytes(self) -> int:
        """While an exchange runs: also the fresh parity it builds (C1 + m x C2)."""
        return self.memory_bytes + self.parity_bytes_per_rank

    def usable(self) -> list[int]:
        """The steps this rank can restore with their parity: the protected one, and the one whose exchange it
        finished when a failure stopped the vote."""
        return [self.base, self.fresh_step if self.delta_to >= 0 and self.fresh_step == self.delta_to else -1]

    def due(self, step: int) -> bool:
        """Whether boundary `step` is one to protect (every rank answers the same)."""
        return self.base < 0 or step - self.base >= self.schedule.interval

    def figures(self) -> dict:
        """For summary.json's `parity` section."""
        local = FlatState(self.local_fn()).nbytes
        return {"parity_bytes_per_rank": self.parity_bytes_per_rank, "local_state_bytes": local,
                "protected_state_bytes": self.state_bytes, "protection_memory_bytes": self.memory_bytes,
                "parity_memory_bytes_per_rank": self.memory_bytes,
                "protection_peak_memory_bytes": self.peak_memory_bytes,
                "protection_memory_ratio": self.memory_bytes / local if local else None,
                "roll_forward": self.reduced is not None,
                "reduced_gradient_bytes": self.reduced.nbytes if self.reduced is not None else 0,
                "parity_group": self.k, "parity_tier2": self.m, "ec_type": self.codec.ec_type if self.codec else None,
                **self.schedule.figures(), "exchange": {k: v for k, v in vars(self.stats).items()}}

    def _set_layout(self, sizes: list[int]) -> None:
        if sizes == self.sizes and self.rows is not None:
            return
        if self.protected:
            raise ParityLost(f"protected state sizes changed from {self.sizes} to {sizes} bytes; the parity held "
                             f"does not fit them")
        self.sizes, b = sizes, max(sizes)
        self.xor = XorLayout.for_state(k=self.k, state_bytes=b)
        if self.m:
            self.rs = RSLayout.for_state(groups=self.groups, m=self.m, state_bytes=b)
            self.codec = self.rs.codec(self.ec_type)
        self.rows = np.zeros((self.k, self.xor.chunk), dtype=np.uint8)
        self.parity2 = np.zeros(self.rs.chunk * self.m if self.rs else 0, dtype=np.uint8)

    def _all_gather(self, values: list[float], dtype=torch.int64) -> np.ndarray:
        mine = torch.tensor(values, dtype=dtype)
        out = torch.zeros(self.world * len(values), dtype=dtype)
        _all_gather_single(out, mine, group=self.world_group)
        return out.view(self.world, len(values)).numpy()

    @staticmethod
    def _failed(generation: int) -> bool:
        return Seam.failed_generation >= generation or Seam.generation != generation

    # -- the live state against the rows --
    def _xor_live(self, flat: FlatState, *, copy: bool = False) -> None:
        """rows ^= the live state in tier 1's layout, or rows <- it (`copy`); the own row, the stripe, is left alone."""
        body = torch.from_numpy(self.rows).view(-1)
        c, cut = self.xor.chunk, self.member * self.xor.chunk
        op = flat.copy_into if copy else flat.xor_into
        op(body[:cut], 0)
        op(body[cut + c:], cut)

    def _restore(self) -> None:
        """Live tensors <- the rows' bytes (a rollback on a survivor, the rebuilt state on a replacement)."""
        flat, body = FlatState(self.state_fn()), torch.from_numpy(self.rows).view(-1)
        c, cut = self.xor.chunk, self.member * self.xor.chunk
        flat.write_from(body[:cut], 0)
        flat.write_from(body[cut + c:], cut)

    def _flat_range(self, lo: int, hi: int) -> np.ndarray:
        """The padded flat state's bytes [lo, hi) read out of the rows (zeros past their end), as a new array."""
        out = np.zeros(hi - lo, dtype=np.uint8)
        body, c, cut, end = self.rows.reshape(-1), self.xor.chunk, self.member * self.xor.chunk, self.xor.padded_bytes
        for a, b, shift in ((lo, min(hi, cut), 0), (max(lo, cut), min(hi, end), c)):
            if a < b:
                out[a - lo:b - lo] = body[a + shift:b + shift]
        return out

    def _data_chunk(self, stripe: int) -> np.ndarray:
        """My tier-2 data chunk for `stripe` (rs.chunk_of on the flat state, without flattening all of it)."""
        c2 = self.rs.chunk
        n = self.rs.data_stripes(self.group_index).index(stripe)
        return self._flat_range(n * c2, (n + 1) * c2)

    # -- keeping parity current --
    def protect(self, step: int, *, step_seconds: float = 0.0) -> None:
        """Start building the parity of the state at boundary `step` (updates applied) in a background thread.
        Call on every rank after a committed update when due(step) (and once at the start), never while an update
        runs; `step_seconds` (the last step's) weighs the protection's cost for `protect_every: auto`."""
        self.settle()
        generation = Seam.generation
        flat = FlatState(self.state_fn())  # here, not in the thread: state() may create optimizer state
        stripes, self._stripes = self._stripes, None  # the last rebuild's stripes, not sent yet (catch_up)
        # a stripe is the hole the protection's reduce-scatter adds the delta's stripe to: it comes first
        self._in_background(lambda: ((stripes is None or self._send_stripes(stripes, generation))
                                     and self._protect(step, generation, flat, step_seconds)), f"dtk-parity-{step}")

    def _in_background(self, work: Callable[[], bool], name: str) -> None:
        """Run `work` (collectives on the keeper's groups, uncounted) in the keeper's thread; its answer, or its
        exception (a bug, with its traceback), is what wait_current() hands the trainer."""
        def run() -> None:
            try:
                with Seam.uncounted():
                    self._result = work()
            except BaseException as e:
                self._result = e

        self._result = False
        self._thread = threading.Thread(target=run, daemon=True, name=name)
        self._thread.start()

    def wait_current(self) -> bool:
        """Block until the last protect() is over; True if its step is protected (the update may start), False if a
        peer failed meanwhile (the seam has flagged it: do not update, recover)."""
        if self._thread is not None:
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

    def _protect(self, step: int, generation: int, flat: FlatState, step_s: float) -> bool:
        st, t0, cpu0 = self.stats, time.perf_counter(), time.thread_time()
        if self.rows is None:
            self._set_layout([int(v) for v in self._all_gather([flat.nbytes])[:, 0]])
            if self._failed(generation):
                return False
        if flat.nbytes != self.sizes[self.rank]:
            raise RuntimeError(f"the protected state changed from {self.sizes[self.rank]} to {flat.nbytes} bytes "
                               f"between step boundaries; parity needs its layout fixed for the whole run")
        self.delta_to, self.fresh_step = step, -1
        self._xor_live(flat)  # rows = base xor step; the own row keeps the stripe of base
        t1 = time.perf_counter()
        fresh1 = np.empty(self.xor.chunk, dtype=np.uint8)
        _reduce_scatter_single(torch.from_numpy(fresh1), torch.from_numpy(self.rows).view(-1),
                               op=dist.ReduceOp.BXOR, group=self.tier1_group)
        wire = self.rows.nbytes * (self.k - 1) / self.k
        t2 = time.perf_counter()
        if self._failed(generation):
            return False
        self.fresh1, encode_s = fresh1, 0.0
        if self.m:
            self.fresh2 = self.parity2.copy()
            sent, encode_s = self._tier2_exchange(self.fresh2)
            wire += sent
            if self._failed(generation):
                return False
        t3 = time.perf_counter()
        self.fresh_step = step
        votes = self._all_gather([1.0, t3 - t0, step_s], dtype=torch.float64)
        if self._failed(generation) or int(votes[:, 0].sum()) != self.world:
            return False
        t4 = time.perf_counter()
        self._commit(flat)
        self.schedule.observe(cost_s=float(votes[:, 1].max()), step_s=float(votes[:, 2].max()))
        t5 = time.perf_counter()
        st.step, st.fill_s, st.tier1_s, st.tier2_s, st.encode_s = step, t1 - t0, t2 - t1, t3 - t2, encode_s
        st.vote_s, st.commit_s, st.seconds, st.bytes = t4 - t3, t5 - t4, t5 - t0, wire
        st.cpu_s = time.thread_time() - cpu0
        for key, v in (("protects", 1), ("seconds", st.seconds), ("cpu_s", st.cpu_s), ("bytes", wire),
                       ("encode_s", encode_s)):
            st.totals[key] += v
        return True

    def _commit(self, flat: FlatState) -> None:
        """The vote passed: rows <- the new step (the live state), its stripe into the own row."""
        self._xor_live(flat, copy=True)
        self.rows[self.member] = self.fresh1
        if self.m:
            self.parity2 = self.fresh2
        self.base, self.delta_to, self.fresh_step, self.fresh1, self.fresh2 = self.delta_to, -1, -1, None, None

    def _settle_delta(self, step: int) -> None:
        """After a failure cut an exchange short: rows <- base or delta_to, whichever every rank agreed on."""
        if self.delta_to < 0:
            return
        # the live state is delta_to (no update ran since): rows xor it is base, a copy of it is delta_to
        self._xor_live(FlatState(self.state_fn()), copy=step == self.delta_to)
        if step == self.delta_to:
            self.rows[self.member] = self.fresh1
            if self.m:
                self.parity2 = self.fresh2
            self.base = step
        self.delta_to, self.fresh_step, self.fresh1, self.fresh2 = -1, -1, None, None

    def _tier2_exchange(self, parity: np.ndarray) -> tuple[float, float]:
        """Send my data chunks (of what the rows hold) to the holders of their stripes; XOR the Reed-Solomon
        parity of the stripes I hold into `parity` (a linear code: parity of a delta updates the parity of the
        state). Returns (bytes sent, encode seconds)."""
        rs, me = self.rs, self.group_index
        send = [[self._data_chunk(s) for s, _ in rs.held(h) if me in rs.data_members(s)] if h != me else []
                for h in range(self.groups)]
        recv_from = [[s for s, _ in rs.held(me) if j in rs.data_members(s)] if j != me else []
                     for j in range(self.groups)]
        received = self._all_to_all(send, [len(r) for r in recv_from])
        got = {(s, j): received[j][n] for j in range(self.groups) for n, s in enumerate(recv_from[j])}
        t0 = time.perf_counter()
        for q, (s, p) in enumerate(rs.held(me)):
            shards = self.codec.encode([got[(s, j)] for j in rs.data_members(s)])
            part = parity[q * rs.chunk:(q + 1) * rs.chunk]
            np.bitwise_xor(part, shards[p], out=part)
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
    def recover(self, lost: list[int], *, committed: int = -1) -> RebuildReport:
        """Run collectively by every rank (survivors and replacements, the ranks in `lost`) once the groups are
        rebuilt (Seam.reconfigure): agree on the step T, roll every survivor back to T, rebuild the lost ranks'
        rows of T (state and parity) and write them into their live tensors, then the engines' replicated state.
        Also repairs a corrupt rank in place (list it in `lost`: its own bytes and parity are not used). Raises
        ParityLost when the parity left cannot do it. `committed`: the steps this survivor has committed.

        Roll forward (resilience.roll_forward): when one rank was lost, every survivor committed T + 1 steps and
        holds step T's sealed reduced gradients, the survivors keep their state of T + 1; the lost rank is rebuilt
        at T, gets its reduced gradients of step T (one XOR-reduce) and makes that step's update itself."""
        self.settle()
        t0 = time.perf_counter()
        generation = Seam.generation
        lost_set = set(lost)
        is_lost = self.rank in lost_set
        red = self.reduced
        kept = [-1, -1, 0, 0] if is_lost or red is None else [committed, red.sealed, len(red.sizes()), sum(red.sizes())]
        with Seam.uncounted():
            if self._stripes is not None:
                self._finish_stripes(lost_set)
            mine = [self.state_bytes] + ([-1, -1] if is_lost or self.rows is None else self.usable())
            table = self._all_gather(mine + [self.schedule.interval] + kept)
            self._check(generation, "agreeing on the step")
            if is_lost:
                self.forget()
            self._set_layout([int(v) for v in table[:, 0]])
            survivors = [r for r in range(self.world) if r not in lost_set]
            step = agree_step({r: [int(v) for v in table[r, 1:3]] for r in survivors}, lost=lost_set)
            self.schedule.adopt(int(table[survivors, 3].max()))
            if not is_lost:
                self._settle_delta(step)
            forward = self._rolls_forward(table[:, 4:], survivors=survivors, lost=lost_set, step=step)
            tier = self._plan_tier(lost_set)
            if tier == 1:
                self._rebuild_tier1(lost_set)
            elif tier == 2:
                self._rebuild_tier2(lost_set)
            if tier and self.m:  # the lost ranks' tier-2 shards: encoded again from the rows, everywhere
                parity2 = np.zeros_like(self.parity2)
                self._tier2_exchange(parity2)
                self.parity2 = parity2
            self._check(generation, f"rebuilding from tier {tier}")
            if is_lost or not forward:
                self._restore()
            grads = 0
            if forward:
                grads = self._roll_forward(survivors=survivors, lost=lost[0], step=step, generation=generation)
            if self.rebuild_fn is not None:
                self.rebuild_fn()
            self._check(generation, "rebuilding the replicated state")
            self.base = step
        self._result = True
        self.rolled_to = step + 1 if forward else -1
        self._stripes = lost_set if tier else None
        report = RebuildReport(step=step + forward, rolled_forward=forward, tier=tier, lost=sorted(lost_set),
                               bytes_decoded=sum(self.sizes[r] for r in lost_set) + grads,
                               seconds=time.perf_counter() - t0)
        log.info("rebuilt rank(s) %s from tier %d at step %d%s: %d bytes in %.3fs", report.lost, tier, step,
                 " and rolled forward" if forward else "", report.bytes_decoded, report.seconds)
        return report

    def _rolls_forward(self, kept: np.ndarray, *, survivors: list[int], lost: set[int], step: int) -> bool:
        """Every rank answers the same from the table's columns (committed, sealed, entries, bytes) per rank."""
        if self.reduced is None or self.roll_forward_fn is None or len(lost) != 1 or not survivors:
            return False
        rows = kept[survivors]
        if len(survivors) % 2 == 0 and not self.reduced.keep_own:
            return False
        return bool((rows[:, 0] == step + 1).all() and (rows[:, 1] == step).all() and rows[0, 2] > 0
                    and (rows[:, 2] == rows[0, 2]).all() and (rows[:, 3] == rows[0, 3]).all())

    def _roll_forward(self, *, survivors: list[int], lost: int, step: int, generation: int) -> int:
        """The lost rank's reduced gradients of `step` from the survivors' (an XOR-reduce over the world), then its
        update of that step (roll_forward_fn). Returns the bytes reduced."""
        red = self.reduced
        assert red is not None and self.roll_forward_fn is not None  # _rolls_forward checked both
        first = self.rank == survivors[0]  # every survivor holds the same layout: the first one sends it
        count = torch.tensor([len(red.order) if first else 0], dtype=torch.int64)
        dist.broadcast(count, survivors[0], group=self.world_group)
        n = int(count[0])
        layout = (torch.tensor(red.sizes() + red.order, dtype=torch.int64) if first
                  else torch.zeros(2 * n, dtype=torch.int64))
        dist.broadcast(layout, survivors[0], group=self.world_group)
        sizes, order = layout[:n].tolist(), layout[n:].tolist()
        self._check(generation, "sending the reduced gradients' layout")
        buf = torch.zeros(sum(sizes), dtype=torch.uint8) if self.rank == lost else red.contribution(survivors=survivors)
        self._reduce_to(lost, buf.numpy(), group=self.world_group)
        self._check(generation, "sending the reduced gradients")
        if self.rank == lost:
            offsets = np.cumsum([0] + sizes)
            self.roll_forward_fn(step, [(key, buf[offsets[i]:offsets[i + 1]].clone()) for i, key in enumerate(order)])
        return int(buf.numel())

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

    def _reduce_to(self, target: int, buf: np.ndarray, group=None) -> None:
        """XOR of every `group` member's `buf` (default: my tier-1 group) into the target's `buf`, a piece at a time
        (the senders send copies)."""
        flat = torch.from_numpy(buf).view(-1)
        for lo in range(0, flat.numel(), PIECE):
            piece = flat[lo:lo + PIECE]
            dist.reduce(piece if self.rank == target else piece.clone(), dst=target, op=dist.ReduceOp.BXOR,
                        group=group or self.tier1_group)

    def _rebuild_tier1(self, lost: set[int]) -> None:
        """XOR-reduces of the rows to the lost member of my group (if it lost one), but for its own row. At the
        lost member's row s the survivors' rows add up to its chunk for stripe s (holder s adds the stripe, the
        others their chunks): the lost rank gets its state back. Its own row, its stripe (the sum of the survivors'
        rows there), is parity only: catch_up() sends it once training has resumed."""
        mine = [r for r in lost if r // self.k == self.group_index]
        if mine:
            own = mine[0] % self.k
            for rows in (self.rows[:own], self.rows[own + 1:]):
                if rows.size:
                    self._reduce_to(mine[0], rows)

    def catch_up(self) -> None:
        """At a step boundary with no protection due, on every rank: start sending the ranks rebuilt by the last
        recovery their stripes, in the background like a protect() (which does it first when it comes sooner). A
        stripe is parity of the others' state, not needed to train on, and half of what a rebuild sends at k = 2:
        sent during the rebuild it was 25 ms of ZeRO-1's 53 ms (19 MB state, 2 ranks) on the survivors' critical
        path, and sent during the redo it slowed the redo as much (2 shared cores). Started after the redo, it
        overlaps the next step's forward and backward; the next update waits for it (wait_current). Should a
        failure come first, a rebuilt rank holds no stripe, so it reports no protected step (base -1) and that
        recovery falls back: "a second failure before a replacement's rows are rebuilt is not recoverable"."""
        if self._stripes is None or self._thread is not None:
            return
        stripes, self._stripes, generation = self._stripes, None, Seam.generation
        self._in_background(lambda: self._send_stripes(stripes, generation), "dtk-parity-stripes")

    def _send_stripes(self, lost: set[int], generation: int) -> bool:
        self._rebuild_stripes(lost)
        if self._failed(generation):
            self._drop_stripes(lost)
            return False
        return True

    def _finish_stripes(self, lost: set[int]) -> None:
        """recover() with the last rebuild's stripes not sent (no boundary since, or a repair in place right after
        a rebuild): a parity group that lost no rank since sends them now; in one that did, the rebuilt rank has
        none. Every member of a group holds the same pending stripes (set by the same recover)."""
        pending, self._stripes = self._stripes, None
        if self.group_index in {r // self.k for r in lost}:
            self._drop_stripes(pending)
        else:
            self._rebuild_stripes(pending)

    def _drop_stripes(self, lost: set[int]) -> None:
        if self.rank in lost:
            self.base = -1  # a rebuilt rank without its stripe: no step of its is protected

    def _rebuild_stripes(self, lost: set[int]) -> None:
        """After the lost members' data is rebuilt: each one's stripe, the XOR of the others' chunks for it."""
        for target in sorted(r for r in lost if r // self.k == self.group_index):
            self._reduce_to(target, self.rows[target % self.k])

    def _rebuild_tier2(self, lost: set[int]) -> None:
        """In my column: every needed survivor sends each lost member its shard of that member's data stripes."""
        rs, me = self.rs, self.group_index
        column_lost = {r // self.k for r in lost if r % self.k == self.member}
        if not column_lost:
            return
        send, recv_from = [], []
        for d in range(self.groups):
            if me in column_lost or d not in column_lost:
                send.append([])
            else:
                send.append([self._shard_of(s) for s in rs.data_stripes(d) if me in rs.sources(s, column_lost)])
        for j in range(self.groups):
            recv_from.append([s for s in rs.data_stripes(me) if j in rs.sources(s, column_lost)]
                             if me in column_lost and j not in column_lost else [])
        received = self._all_to_all(send, [len(r) for r in recv_from])
        if me in column_lost:
            shards: dict[int, dict[int, np.ndarray]] = {}
            for j in range(self.groups):
                for n, s in enumerate(recv_from[j]):
                    shards.setdefault(s, {})[rs.shard_index(s, j)] = received[j][n]
            self.rows[:] = self.xor.rows(rs.rebuild(me, shards, self.codec)[:self.xor.padded_bytes], self.member)

    def _shard_of(self, stripe: int) -> np.ndarray:
        """What I send to rebuild `stripe`: my data chunk of it, or my parity shard of it (rs.shard_of)."""
        rs, me = self.rs, self.group_index
        if me in rs.data_members(stripe):
            return self._data_chunk(stripe)
        q = [sp[1] for sp in rs.held(me)].index(rs.holders(stripe).index(me))
        return self.parity2[q * rs.chunk:(q + 1) * rs.chunk]

    # -- corruption --
    def mismatched_bytes(self) -> int:
        """Bytes of the live state that differ from the protected step (right after a protect and before the next
        update they must be equal: a difference is a bit flip). Local, no collective."""
        if not self.protected or self.delta_to >= 0:
            return 0
        live = torch.zeros(self.xor.padded_bytes, dtype=torch.uint8)
        FlatState(self.state_fn()).xor_into(live, 0)
        return int(np.count_nonzero(self.xor.flat(self.rows, self.member) != live.numpy()))


def build_keeper(*, state: Callable[[], list[torch.Tensor]], resilience, nproc_per_node: int,
                 rebuild: Callable[[], None] | None = None,
                 local_state: Callable[[], list[torch.Tensor]] | None = None) -> ParityKeeper:
    """The keeper a recipe asks for, on every rank (a replacement too), after the default group exists."""
    k, m = parity_layout(resilience, world=dist.get_world_size(), nproc_per_node=nproc_per_node)
    schedule = ProtectSchedule(every=resilience.protect_every, mtbf_s=resilience.mtbf_s or DEFAULT_MTBF_S)
    return ParityKeeper(state=state, group_size=k, tier2=m, rebuild=rebuild, local_state=local_state,
                        schedule=schedule)
