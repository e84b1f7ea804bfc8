"""What a rank keeps of the last step's reduced gradients so that a rank lost in that step's update can make the
update again (a roll forward, `resilience.roll_forward`): the XOR of the other ranks' chunks of every reduce-scatter.

On gloo the seam runs a reduce-scatter as an all-reduce of the whole input, then takes this rank's chunk
(dtk.comm.group._reduce_scatter_base), so for a moment every rank holds every rank's reduced chunk. Keeping
Z = XOR of the chunks of the others costs one gradient shard. After rank L is lost with n survivors, L's chunk is
the XOR of the survivors' Z when n is odd (each other survivor's chunk appears in n - 1 of them, an even count; L's
in all n). When n is even (an odd world), one survivor sends its own chunk instead of its Z, which adds the XOR of
all chunks and makes the count right again: in an odd world each rank also keeps its own chunk (two shards).

The record of step S is kept until the first reduce-scatter of step S + 1 completes: that one needed every rank,
so every rank had committed S. A record is usable only once sealed: the engine matched every entry to its
gradients after the step's last backward (`seal`), giving each entry the key it puts it back by (`order`).
"""
from __future__ import annotations

import threading

import torch


def xor_others(rows: torch.Tensor, rank: int) -> torch.Tensor:
    """rows: world x n bytes; the XOR of every row but `rank`'s, as a new tensor."""
    others = [j for j in range(rows.shape[0]) if j != rank]
    out = rows[others[0]].clone()
    for j in others[1:]:
        out.bitwise_xor_(rows[j])
    return out


def _words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as the widest integers that tile each row (XOR is 8x faster on int64)."""
    flat = t.reshape(t.shape[0], -1).view(torch.uint8)
    for dtype, size in ((torch.int64, 8), (torch.int32, 4)):
        if flat.shape[1] % size == 0:
            return flat.view(dtype)
    return flat


class ReducedGrads:
    """One per rank, fed by the seam (`add`, from whichever thread completes a reduce-scatter) while armed by the
    trainer (`begin` ... `seal`)."""

    def __init__(self, *, rank: int, world: int):
        self.rank, self.world = rank, world
        self.keep_own = world % 2 == 1
        self._lock = threading.Lock()
        self._recording = -1
        """The step whose backward runs now (-1: not armed)."""
        self._fresh = False
        """Armed, and no reduce-scatter of the armed step completed yet: the next one replaces the entries."""
        self.step = -1
        """The step the entries belong to."""
        self.sealed = -1
        """The step whose record is whole and matched to the engine's gradients (-1: none)."""
        self._entries: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []
        """(storage address of this rank's output, Z as bytes, this rank's own chunk as bytes or None)."""
        self.order: list[int] = []
        """After `seal`: the engine's key (e.g. FSDP's parameter group) of each entry, in order."""

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(z.numel() + (0 if own is None else own.numel()) for _, z, own in self._entries)

    def begin(self, step: int) -> None:
        with self._lock:
            self._recording, self._fresh = step, True

    def add(self, buf: torch.Tensor, output: torch.Tensor) -> None:
        """buf: the all-reduced input of a reduce-scatter (world chunks, in rank order); output: this rank's chunk's
        destination (the engine finds its gradients by its storage)."""
        with self._lock:
            if self._recording < 0:
                return
            if self._fresh:  # this step's first whole reduce-scatter: every rank committed the step before
                self._entries, self.order, self.sealed, self.step = [], [], -1, self._recording
                self._fresh = False
            rows = _words(buf.detach().reshape(self.world, -1))
            own = rows[self.rank].view(torch.uint8).clone() if self.keep_own else None
            self._entries.append((output.untyped_storage().data_ptr(), xor_others(rows, self.rank).view(torch.uint8),
                                  own))

    def seal(self, step: int, keys: dict[int, int] | list[list[tuple[int, int]]] | None) -> None:
        """After the step's last backward: `keys` maps the storage address of each of the engine's reduced outputs to
        the engine's key for it; or lists, for each reduce-scatter of the step in order, the (key, bytes) of the
        pieces its output holds back to back (each piece becomes an entry: ZeRO-3's parameters of a bucket); None
        when the engine cannot make its update alone (e.g. clipping needs a norm)."""
        with self._lock:
            self._recording = -1
            if self._fresh:  # none of this step's reduce-scatters completed (a peer failed): the last record stands
                self._fresh = False
                return
            self.sealed, self.order = -1, []
            if keys is None or self.step != step:
                return
            if isinstance(keys, dict):
                ptrs = [p for p, _, _ in self._entries]
                if sorted(ptrs) == sorted(keys):
                    self.order, self.sealed = [keys[p] for p in ptrs], step
                return
            if len(keys) != len(self._entries) or any(sum(n for _, n in pieces) != z.numel()
                                                     for pieces, (_, z, _) in zip(keys, self._entries)):
                return
            entries, order = [], []
            for pieces, (ptr, z, own) in zip(keys, self._entries):
                at = 0
                for key, n in pieces:
                    entries.append((ptr, z[at:at + n], None if own is None else own[at:at + n]))
                    order.append(key)
                    at += n
            self._entries, self.order, self.sealed = entries, order, step

    def sizes(self) -> list[int]:
        with self._lock:
            return [z.numel() for _, z, _ in self._entries]

    def contribution(self, *, survivors: list[int]) -> torch.Tensor:
        """What this survivor adds to the XOR-reduce that gives the lost rank its chunks (see the module's
        docstring): its Z, or its own chunks when the survivors are even in number and it is the first of them."""
        with self._lock:
            own = len(survivors) % 2 == 0 and self.rank == survivors[0]
            parts = []
            for _, z, mine in self._entries:
                if own and mine is None:
                    raise RuntimeError("an even number of survivors needs a rank's own chunks; this world keeps none")
                parts.append(mine if own and mine is not None else z)
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
