"""The erasure codes of dtk's parity, on byte buffers (numpy uint8): tier 1 is XOR inside a group of k ranks in a
RAID-5 layout, tier 2 is Reed-Solomon (pyeclib / liberasurecode, ISA-L) across groups. Layouts and codes only:
who sends what over which process group is `dtk.resilience.parity`'s job.

Tier 1 (`XorLayout`). A member's state, padded to B bytes (B divisible by k-1), is cut into k-1 chunks of
C = B/(k-1) bytes. Chunk c goes to stripe `stripes_of(member)[c]`, the c-th member other than itself; stripe s is
the XOR of the k-1 chunks sent to it and is held by member s, so no member holds parity of its own bytes. Laid out
as a k x C "rows" buffer (row s = the chunk for stripe s, row `member` = zeros), the parity exchange is one
reduce-scatter with BXOR, and the flat state is the rows buffer with one C-byte hole at row `member`.
Any one lost member is rebuilt: chunk c of member L = stripe s XOR the other members' chunks for s.

Tier 2 (`RSLayout`). Across the G groups, the members at the same position form a column of G ranks. Each column
is split into G stripes; stripe s is held by m members `holders(s)` = s, s+1, ..., s+m-1 (mod G), one parity shard
each, and takes one data chunk (C2 = B/(G-m) bytes) from each of the other G-m members. So a member never holds
parity of its own bytes, each stripe is an RS(G-m data, m parity) code, and any m lost members of a column (m whole
groups) leave every stripe at least G-m of its G shards. Memory per rank: m * C2 = m * B / (G-m).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

ALIGN = 64
"""Chunk sizes are multiples of this: liberasurecode then pads nothing and a fragment's payload is the chunk."""
HEADER = 80
"""liberasurecode's fragment header (fragment_header_t); it depends only on the fragment's index and size."""
EC_TYPES = ("isa_l_rs_cauchy", "isa_l_rs_vand", "liberasurecode_rs_vand")
"""Reed-Solomon backends tried in this order; the first that loads is used (all three ship in pyeclib's wheel)."""


def padded(nbytes: int, parts: int) -> int:
    """The smallest length >= nbytes that splits into `parts` chunks of a multiple of ALIGN bytes (at least one)."""
    unit = parts * ALIGN
    return max(unit, -(-nbytes // unit) * unit)


# ---------------------------------------------------------------- tier 1: XOR, RAID-5 layout inside a group


@dataclass(frozen=True, slots=True)
class XorLayout:
    """Tier 1 in a group of k members: member m's chunk c goes to stripe stripes_of(m)[c]; stripe s is held by s."""

    k: int
    chunk: int
    """C: bytes per chunk, per stripe and of the parity each member holds."""

    @classmethod
    def for_state(cls, *, k: int, state_bytes: int) -> "XorLayout":
        if k < 2:
            raise ValueError(f"a parity group needs at least 2 members, got {k}")
        return cls(k=k, chunk=padded(state_bytes, k - 1) // (k - 1))

    @property
    def padded_bytes(self) -> int:
        return self.chunk * (self.k - 1)

    def stripes_of(self, member: int) -> list[int]:
        return [s for s in range(self.k) if s != member]

    def rows(self, flat: np.ndarray, member: int) -> np.ndarray:
        """The k x C send buffer of `member`: its flat state (zero-padded) with a zero row at its own position."""
        out = np.zeros((self.k, self.chunk), dtype=np.uint8)
        body = out.reshape(-1)
        cut = member * self.chunk
        head = min(len(flat), cut)
        body[:head] = flat[:head]
        if len(flat) > cut:
            body[cut + self.chunk:cut + self.chunk + len(flat) - cut] = flat[cut:]
        return out

    def flat(self, rows: np.ndarray, member: int) -> np.ndarray:
        """The inverse of rows(): the padded flat state (a copy)."""
        return np.delete(rows, member, axis=0).reshape(-1)

    def encode(self, datas: list[np.ndarray]) -> list[np.ndarray]:
        """Every member's stripe from every member's flat state, in one process (what the reduce-scatter computes)."""
        total = np.zeros((self.k, self.chunk), dtype=np.uint8)
        for member, data in enumerate(datas):
            np.bitwise_xor(total, self.rows(data, member), out=total)
        return list(total)

    def contribution(self, *, member: int, lost: int, rows: np.ndarray, parity: np.ndarray) -> np.ndarray:
        """What a surviving `member` adds (XOR) to rebuild `lost`: its own stripe in its row, its chunks elsewhere,
        zeros in the lost member's row. The XOR over all survivors is the lost member's rows buffer."""
        out = rows.copy()
        out[member] = parity
        out[lost] = 0
        return out

    def decode(self, lost: int, datas: list[np.ndarray | None], parities: list[np.ndarray | None]) -> np.ndarray:
        """The lost member's padded flat state from the others' flat states and stripes, in one process."""
        total = np.zeros((self.k, self.chunk), dtype=np.uint8)
        for member in range(self.k):
            if member != lost:
                data, parity = datas[member], parities[member]
                assert data is not None and parity is not None  # None only for the lost member
                rows = self.rows(data, member)
                np.bitwise_xor(total, self.contribution(member=member, lost=lost, rows=rows,
                                                        parity=parity), out=total)
        return self.flat(total, lost)


# ---------------------------------------------------------------- tier 2: Reed-Solomon across groups


@functools.lru_cache(maxsize=None)
def _driver(k: int, m: int, ec_type: str | None):
    from pyeclib.ec_iface import ECDriver

    errors = []
    for name in ([ec_type] if ec_type else EC_TYPES):
        try:
            return ECDriver(k=k, m=m, ec_type=name)
        except Exception as e:  # a backend missing from this build of liberasurecode: try the next one
            errors.append(f"{name}: {e}")
    raise RuntimeError(f"no Reed-Solomon backend of pyeclib loads for k={k}, m={m}: {'; '.join(errors)}")


class RSCodec:
    """Reed-Solomon with k data and m parity shards of `chunk` bytes each (systematic: data shards are the data)."""

    def __init__(self, *, k: int, m: int, chunk: int, ec_type: str | None = None):
        if chunk % ALIGN:
            raise ValueError(f"chunk must be a multiple of {ALIGN} bytes, got {chunk}")
        self.k, self.m, self.chunk = k, m, chunk
        if k == 1:
            # One data shard: every MDS code is a repetition code, and ISA-L's encode of k=1 measured 5-10x slower
            # here than of k=2; copies are the same code, done by numpy.
            self.driver, self.ec_type = None, "repetition"
            return
        self.driver = _driver(k, m, ec_type)
        self.ec_type = self.driver.ec_type.name if hasattr(self.driver.ec_type, "name") else str(self.driver.ec_type)
        # Headers hold only (index, sizes, backend): those of an all-zero encode frame any payload of this shape.
        self._headers = [f[:HEADER] for f in self.driver.encode(bytes(k * chunk))]
        if any(len(f) != HEADER + chunk for f in self.driver.encode(bytes(k * chunk))):
            raise RuntimeError(f"{self.ec_type}: fragments of k={k} x {chunk} bytes are padded; cannot frame shards")

    def encode(self, data: list[np.ndarray]) -> list[np.ndarray]:
        """The m parity shards of k data shards."""
        if self.driver is None:
            return [data[0].copy() for _ in range(self.m)]
        frags = self.driver.encode(np.concatenate(data).tobytes())
        return [np.frombuffer(f, dtype=np.uint8, offset=HEADER).copy() for f in frags[self.k:]]

    def decode(self, shards: dict[int, np.ndarray]) -> list[np.ndarray]:
        """The k data shards from any k shards {index: payload} (index < k: data, k + p: parity p)."""
        if len(shards) < self.k:
            raise ValueError(f"Reed-Solomon needs {self.k} of {self.k + self.m} shards, got {sorted(shards)}")
        if self.driver is None:
            return [shards[min(shards)].copy()]
        frags = [self._headers[i] + np.ascontiguousarray(shards[i]).tobytes() for i in sorted(shards)[:self.k]]
        data = np.frombuffer(self.driver.decode(frags), dtype=np.uint8)
        return [data[i * self.chunk:(i + 1) * self.chunk].copy() for i in range(self.k)]


@dataclass(frozen=True, slots=True)
class RSLayout:
    """Tier 2 in a column of G members (one per group) with m parity shards per stripe."""

    g: int
    m: int
    chunk: int
    """C2: bytes per data chunk and per parity shard."""

    @classmethod
    def for_state(cls, *, groups: int, m: int, state_bytes: int) -> "RSLayout":
        if not 1 <= m < groups:
            raise ValueError(f"tier 2 with m={m} parity shards needs at least m+1 groups, got {groups}")
        return cls(g=groups, m=m, chunk=padded(state_bytes, groups - m) // (groups - m))

    @property
    def padded_bytes(self) -> int:
        return self.chunk * (self.g - self.m)

    def holders(self, stripe: int) -> list[int]:
        """Members holding stripe's parity shards 0..m-1, in shard order."""
        return [(stripe + p) % self.g for p in range(self.m)]

    def data_members(self, stripe: int) -> list[int]:
        """Members whose chunks are stripe's data shards 0..G-m-1, in shard order."""
        held = set(self.holders(stripe))
        return [j for j in range(self.g) if j not in held]

    def held(self, member: int) -> list[tuple[int, int]]:
        """(stripe, parity shard index) pairs that `member` holds, shard p of stripe member-p."""
        return [((member - p) % self.g, p) for p in range(self.m)]

    def data_stripes(self, member: int) -> list[int]:
        """Stripes that take member's chunks: chunk c goes to data_stripes(member)[c]."""
        return [s for s in range(self.g) if member in self.data_members(s)]

    def shard_index(self, stripe: int, member: int) -> int:
        """Which shard of `stripe` `member` provides (its data chunk, or its parity shard k + p)."""
        data = self.data_members(stripe)
        if member in data:
            return data.index(member)
        return len(data) + self.holders(stripe).index(member)

    def sources(self, stripe: int, lost: set[int]) -> list[int]:
        """The G-m surviving members whose shards rebuild `stripe` (the first ones, in member order)."""
        alive = [j for j in range(self.g) if j not in lost]
        if len(alive) < self.g - self.m:
            raise ValueError(f"stripe {stripe}: {len(lost)} members lost, tier 2 survives at most {self.m}")
        return alive[:self.g - self.m]

    def chunk_of(self, flat: np.ndarray, member: int, stripe: int) -> np.ndarray:
        """member's data chunk for stripe (zero-padded past the end of its state)."""
        c = self.data_stripes(member).index(stripe)
        out = np.zeros(self.chunk, dtype=np.uint8)
        piece = flat[c * self.chunk:(c + 1) * self.chunk]
        out[:len(piece)] = piece
        return out

    def codec(self, ec_type: str | None = None) -> RSCodec:
        return RSCodec(k=self.g - self.m, m=self.m, chunk=self.chunk, ec_type=ec_type)

    def encode(self, datas: list[np.ndarray], codec: RSCodec | None = None) -> list[np.ndarray]:
        """Every member's parity holding (m shards, concatenated in held() order), in one process."""
        codec = codec or self.codec()
        parity = {}
        for s in range(self.g):
            shards = codec.encode([self.chunk_of(datas[j], j, s) for j in self.data_members(s)])
            for p, holder in enumerate(self.holders(s)):
                parity[(s, p)] = shards[p]
        return [np.concatenate([parity[sp] for sp in self.held(j)]) for j in range(self.g)]

    def shard_of(self, *, member: int, stripe: int, flat: np.ndarray | None, parity: np.ndarray | None) -> np.ndarray:
        """What surviving `member` sends to rebuild `stripe`: its data chunk, or its parity shard of it (only the
        one it sends need be given)."""
        if member in self.data_members(stripe):
            assert flat is not None
            return self.chunk_of(flat, member, stripe)
        assert parity is not None
        p = self.holders(stripe).index(member)
        q = [sp[1] for sp in self.held(member)].index(p)
        return parity[q * self.chunk:(q + 1) * self.chunk]

    def rebuild(self, lost_member: int, shards: dict[int, dict[int, np.ndarray]], codec: RSCodec) -> np.ndarray:
        """A lost member's padded flat state from {stripe: {shard index: payload}} of its data stripes."""
        out = []
        for s in self.data_stripes(lost_member):
            data = codec.decode(shards[s])
            out.append(data[self.data_members(s).index(lost_member)])
        return np.concatenate(out)

    def decode(self, lost: set[int], datas: list[np.ndarray | None], parities: list[np.ndarray | None],
               codec: RSCodec | None = None) -> dict[int, np.ndarray]:
        """Every lost member's padded flat state from the survivors' states and parity, in one process."""
        codec = codec or self.codec()
        out = {}
        for d in sorted(lost):
            shards = {s: {self.shard_index(s, j): self.shard_of(member=j, stripe=s, flat=datas[j],
                                                                parity=parities[j])
                          for j in self.sources(s, lost)}
                      for s in self.data_stripes(d)}
            out[d] = self.rebuild(d, shards, codec)
        return out
