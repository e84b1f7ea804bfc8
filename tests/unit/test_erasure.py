"""The erasure codes themselves: encode, drop every allowed set of members, decode, bytes equal (odd lengths too)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from dtk.resilience.erasure import ALIGN, RSCodec, RSLayout, XorLayout, padded


def _states(sizes: list[int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=n, dtype=np.uint8) for n in sizes]


def _padded(data: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n, dtype=np.uint8)
    out[:len(data)] = data
    return out


@pytest.mark.parametrize("sizes", [[1000, 1000], [777, 1001, 13], [4097, 4096, 5, 4095], [1, 0, 3, 2, 9]])
def test_xor_rebuilds_any_one_member(sizes):
    k = len(sizes)
    layout = XorLayout.for_state(k=k, state_bytes=max(sizes))
    assert layout.padded_bytes % (k - 1) == 0 and layout.chunk % ALIGN == 0
    datas = _states(sizes, seed=k)
    parities = layout.encode(datas)
    assert all(len(p) == layout.chunk for p in parities)
    for lost in range(k):
        others = [None if j == lost else d for j, d in enumerate(datas)]
        stripes = [None if j == lost else p for j, p in enumerate(parities)]
        rebuilt = layout.decode(lost, others, stripes)
        assert rebuilt[:sizes[lost]].tobytes() == datas[lost].tobytes()
        assert not rebuilt[sizes[lost]:].any()


def test_xor_no_member_holds_its_own_parity():
    """A member's bytes change no stripe it holds: losing it never loses the parity of its own data."""
    layout = XorLayout.for_state(k=4, state_bytes=3000)
    datas = _states([3000] * 4, seed=1)
    before = layout.encode(datas)
    for j in range(4):
        flipped = [d.copy() for d in datas]
        flipped[j] ^= 0xFF
        after = layout.encode(flipped)
        assert np.array_equal(after[j], before[j])
        assert all(not np.array_equal(after[s], before[s]) for s in range(4) if s != j)


def test_xor_rows_round_trip():
    layout = XorLayout.for_state(k=3, state_bytes=300)
    data = _states([300], seed=2)[0]
    for member in range(3):
        rows = layout.rows(data, member)
        assert not rows[member].any()
        assert np.array_equal(layout.flat(rows, member), _padded(data, layout.padded_bytes))


def test_padded_lengths():
    assert padded(0, 3) == 3 * ALIGN
    assert padded(3 * ALIGN + 1, 3) == 6 * ALIGN
    assert padded(1, 1) == ALIGN


@pytest.mark.parametrize("groups,m", [(2, 1), (3, 1), (3, 2), (4, 2), (5, 3)])
def test_rs_rebuilds_any_m_lost_members(groups, m):
    sizes = [1000 + 37 * j for j in range(groups)]
    layout = RSLayout.for_state(groups=groups, m=m, state_bytes=max(sizes))
    codec = layout.codec()
    datas = _states(sizes, seed=groups * 10 + m)
    parities = layout.encode(datas, codec)
    assert all(len(p) == m * layout.chunk for p in parities)
    for n_lost in range(1, m + 1):
        for lost in itertools.combinations(range(groups), n_lost):
            others = [None if j in lost else d for j, d in enumerate(datas)]
            stripes = [None if j in lost else p for j, p in enumerate(parities)]
            rebuilt = layout.decode(set(lost), others, stripes, codec)
            for d in lost:
                assert rebuilt[d][:sizes[d]].tobytes() == datas[d].tobytes()


@pytest.mark.parametrize("groups,m", [(2, 1), (4, 2), (5, 2)])
def test_rs_layout_spreads_parity_off_its_data(groups, m):
    layout = RSLayout.for_state(groups=groups, m=m, state_bytes=100)
    for s in range(groups):
        assert len(set(layout.holders(s))) == m
        assert not set(layout.holders(s)) & set(layout.data_members(s))
    for j in range(groups):
        assert len(layout.data_stripes(j)) == groups - m
        assert len(layout.held(j)) == m


@pytest.mark.parametrize("k,m", [(3, 2), (1, 2), (2, 1)])
def test_rs_codec_any_k_of_n(k, m):
    codec = RSCodec(k=k, m=m, chunk=2 * ALIGN)
    data = _states([2 * ALIGN] * k, seed=5)
    shards = data + codec.encode(data)
    for keep in itertools.combinations(range(k + m), k):
        got = codec.decode({i: shards[i] for i in keep})
        assert all(np.array_equal(a, b) for a, b in zip(got, data))


def test_rs_too_many_lost_is_refused():
    layout = RSLayout.for_state(groups=3, m=1, state_bytes=100)
    with pytest.raises(ValueError, match="at most 1"):
        layout.sources(0, {0, 1})
    with pytest.raises(ValueError, match="m\\+1 groups"):
        RSLayout.for_state(groups=2, m=2, state_bytes=100)
