"""dtk's p2p collectives against gloo's native ops on 2, 3 and 4 real ranks, odd sizes and odd orders included."""
from __future__ import annotations

import datetime

import pytest

from dtk.bench import spawn_ranks

pytestmark = pytest.mark.dist

NUMELS = [7, 30011]   # odd sizes; 30011 float32 = 117 KB: 30 pieces of 4 KB
CHUNK = 4096


def _orders(p: int) -> list[list[int]]:
    return [list(range(p)), [0, 2, 1, 3] if p == 4 else list(reversed(range(p)))]


def _check_rank(rank: int, p: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from dtk.comm import algorithms as A

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(dist.PrefixStore("algo", store), rank, p, datetime.timedelta(seconds=60))
    errors: list[str] = []

    def close(name, got, want):
        if not torch.allclose(got, want, rtol=1e-6, atol=1e-6):
            errors.append(f"rank {rank} {name}: max diff {float((got - want).abs().max())}")

    for numel in NUMELS:
        g = torch.Generator().manual_seed(1000 * numel + rank)
        x = torch.randn(numel, generator=g)
        want = x.clone()
        pg.allreduce([want]).wait()
        for order in _orders(p):
            t = x.clone()
            A.ring_all_reduce(A.P2P(pg), t, order=order, chunk_bytes=CHUNK)
            close(f"ring_all_reduce n={numel} order={order}", t, want)
            # all-gather / reduce-scatter: rank r's part is parts[r]; odd part sizes too
            parts = [torch.randn(numel, generator=torch.Generator().manual_seed(7 * r + numel)) + rank
                     for r in range(p)]
            out = torch.empty(numel)
            A.ring_reduce_scatter(A.P2P(pg), out, parts, order=order, chunk_bytes=CHUNK)
            ref = [q.clone() for q in parts]
            for q in ref:
                pg.allreduce([q]).wait()
            close(f"ring_reduce_scatter n={numel} order={order}", out, ref[rank])
            flat = torch.empty(p * numel)
            A.ring_all_gather(A.P2P(pg), list(flat.split(numel)), x, order=order, chunk_bytes=CHUNK)
            native = [torch.empty(numel) for _ in range(p)]
            pg.allgather([native], [x]).wait()
            close(f"ring_all_gather n={numel} order={order}", flat, torch.cat(native))
        for kind, root in [("binomial", p - 1), ("binary", 1)]:
            order = _orders(p)[-1]
            t = x.clone()
            A.tree_all_reduce(A.P2P(pg), t, root=root, kind=kind, order=order, chunk_bytes=CHUNK)
            close(f"tree_all_reduce {kind} root={root} n={numel}", t, want)
            t = x.clone()
            A.tree_reduce(A.P2P(pg), t, root=root, kind=kind, chunk_bytes=CHUNK)
            if rank == root:
                close(f"tree_reduce {kind} root={root} n={numel}", t, want)
            t = x.clone() if rank == root else torch.zeros(numel)
            A.tree_broadcast(A.P2P(pg), t, root=root, kind=kind, chunk_bytes=CHUNK)
            src = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * numel + root))
            close(f"tree_broadcast {kind} root={root} n={numel}", t, src)
        layouts = [([[p - 1] + list(range(p - 1))], {})]
        if p >= 3:  # a leaf whose result comes back from another leader (the congested-host plan)
            layouts.append(([[1, 0]] + [[r] for r in range(2, p)], {0: 2}))
        for groups, back in layouts:
            t = x.clone()
            A.hierarchical_all_reduce(A.P2P(pg), t, groups=groups, back=back, chunk_bytes=CHUNK)
            close(f"hierarchical_all_reduce groups={groups} back={back} n={numel}", t, want)
    pg.barrier().wait()
    if rank == 0:
        queue.put(errors)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_algorithms_equal_native(p):
    errors = spawn_ranks(_check_rank, nproc=p, timeout_s=200)
    assert errors == [], "\n".join(errors[:20])
