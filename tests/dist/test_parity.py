"""Parity of real ranks' state on gloo, through the seam: a SIGKILLed rank rebuilt bit for bit from tier 1 by a
fresh replacement process (the survivors rolled back from a half-done update), a whole parity group killed and
rebuilt from tier 2, and a flipped bit / a zeroed rank repaired in place. States mix dtypes and odd lengths."""
from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import pytest
import torch

pytestmark = [pytest.mark.dist]


def _state(rank: int) -> list[torch.Tensor]:
    """A rank's local state at step 0: mixed dtypes, odd byte counts, a 0-dim counter, sizes differ per rank."""
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(37 + 5 * rank, generator=g),
            torch.randn(3, 5, generator=g).to(torch.bfloat16),
            torch.randint(-1000, 1000, (11,), dtype=torch.int64, generator=g),
            torch.tensor(0.0),
            torch.randint(0, 255, (7 + rank,), dtype=torch.uint8, generator=g)]


def _update(state: list[torch.Tensor], step: int, *, only: int | None = None) -> None:
    """The update that takes the state to boundary `step`; `only` = apply it to the first tensors only (a half-done
    update, as when a peer dies in the middle of an optimizer step)."""
    with torch.no_grad():
        for i, t in enumerate(state[:only]):
            if t.is_floating_point():
                t.mul_(0.5).add_(step * 0.25 + i) if t.dim() else t.fill_(float(step))
            else:
                t.add_(step * 3 + i)


def _expected(rank: int, step: int) -> list[torch.Tensor]:
    state = _state(rank)
    for s in range(1, step + 1):
        _update(state, s)
    return state


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(x.dtype == y.dtype and torch.equal(x.view(torch.uint8) if x.dim() else x.reshape(1).view(torch.uint8),
                                                  y.view(torch.uint8) if y.dim() else y.reshape(1).view(torch.uint8))
               for x, y in zip(a, b))


def _rank(rank, world, port, results, scenario, group_size, tier2, join):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from dtk.comm.group import Seam, register
    from dtk.resilience.parity import ParityKeeper

    register()
    Seam.joining = join is not None
    Seam.generation = join or 0
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("dtk", store=dist.PrefixStore("w", store), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    if join is None:
        threading.Thread(target=_watch, args=(port,), daemon=True).start()
    state = _state(rank)
    keeper = ParityKeeper(state=lambda: state, group_size=group_size, tier2=tier2)
    out = {"rank": rank}
    if join is not None:  # a replacement: fresh process, fresh state, joins the survivors' next generation
        Seam.reconfigure(join)
        out["report"] = vars(keeper.recover(_victims(scenario)))
        _continue(keeper, state, out["report"]["step"], rank, out)
        _leave(results, out)
    keeper.protect(0)
    assert keeper.wait_current()
    _update(state, 1)
    keeper.protect(1)
    assert keeper.wait_current()
    out["parity_bytes_per_rank"] = keeper.parity_bytes_per_rank
    out["state_bytes"] = keeper.state_bytes
    if scenario in ("kill", "group"):
        if rank in _victims(scenario):
            _update(state, 2)
            os.kill(os.getpid(), signal.SIGKILL)
        # survivors: rank 0 finishes update 2 and tries to protect it; the others die-with-it half-way
        if rank == 0:
            _update(state, 2)
            keeper.protect(2)
            out["protect_2"] = keeper.wait_current()
        else:
            _update(state, 2, only=2)
        dist.all_reduce(torch.ones(1))  # the strategy's next collective: released by the seam, flagged
        out["failure_seen"] = Seam.take_failure() is not None
        keeper.settle()
        Seam.reconfigure(1)
        out["report"] = vars(keeper.recover(_victims(scenario)))
    else:  # in place, no process lost: a flipped bit on rank 2, then rank 1's tensors zeroed
        if rank == 2:
            state[0].view(torch.int32)[3] ^= 1 << 7
        out["mismatched"] = keeper.mismatched_bytes()
        out["report"] = vars(keeper.recover([2]))
        out["repaired_bit"] = _same(state, _expected(rank, 1))
        keeper.catch_up()  # the step boundary after a rebuild: rank 2's stripe, in the background
        assert keeper.wait_current()
        if rank == 1:
            for t in state:
                t.zero_()
        out["report_zeroed"] = vars(keeper.recover([1]))
    _continue(keeper, state, out["report"]["step"], rank, out)
    if scenario == "corrupt":  # a rank repaired, then its group's next repair before a boundary sent its stripe
        from dtk.resilience.parity import ParityLost

        keeper.recover([2])
        try:
            keeper.recover([1])
        except ParityLost as e:
            out["stripe_missing"] = str(e)
    _leave(results, out)


def _leave(results, out: dict) -> None:
    results.put(out)
    # no interpreter teardown: gloo's threads abort it ("terminate called without an active exception")
    os._exit(0)


def _watch(port: int) -> None:
    """The launcher's failure notice, as dtk.resilience.control's watcher: release every blocked collective (a
    survivor may be waiting on another survivor that will never join, not on the dead rank)."""
    import torch.distributed as dist

    from dtk.comm.group import Seam

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    while not store.check(["failure"]):
        time.sleep(0.01)
    Seam.release(store.get("failure").decode(), generation=0)


def _victims(scenario: str) -> list[int]:
    return {"kill": [1], "group": [2, 3]}.get(scenario, [])


def _continue(keeper, state, step: int, rank: int, out: dict) -> None:
    """After the rebuild every rank holds step `step` bit for bit; the next update and its parity go on as usual."""
    out["rebuilt_exact"] = _same(state, _expected(rank, step))
    out["reprotected"] = keeper.wait_current()
    _update(state, step + 1)
    keeper.protect(step + 1)
    out["next_protected"] = keeper.wait_current()
    out["next_exact"] = _same(state, _expected(rank, step + 1))
    import torch.distributed as dist
    dist.barrier()


def _run(scenario: str, *, world: int, group_size: int, tier2: int = 0, timeout_s: float = 150) -> dict[int, dict]:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from dtk.rendezvous import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    args = (world, port, results, scenario, group_size, tier2)
    procs = {r: ctx.Process(target=_rank, args=(r, *args, None), daemon=True) for r in range(world)}
    for p in procs.values():
        p.start()
    victims, replaced, got = _victims(scenario), [], {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world:
            for r in victims:
                if r not in replaced and procs[r].exitcode is not None:
                    assert procs[r].exitcode == -signal.SIGKILL, f"rank {r} exited {procs[r].exitcode}"
                    replaced.append(r)
                    store.set("failure", f"rank {r} died")
                    procs[r] = ctx.Process(target=_rank, args=(r, *args, 1), daemon=True)
                    procs[r].start()
            while not results.empty():
                out = results.get()
                got[out["rank"]] = out
            time.sleep(0.05)
            bad = {r: p.exitcode for r, p in procs.items() if p.exitcode not in (None, 0) and r not in victims}
            assert not bad, f"ranks failed: {bad}"
            assert time.monotonic() < deadline, f"only ranks {sorted(got)} finished in {timeout_s}s"
    finally:
        for p in procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        del store
    return got


def _check_rebuilt(got: dict[int, dict], *, tier: int, step: int) -> None:
    for r, out in got.items():
        rep = out["report"]
        assert (rep["tier"], rep["step"]) == (tier, step), (r, rep)
        assert out["rebuilt_exact"] and out["reprotected"] and out["next_protected"] and out["next_exact"], (r, out)


@pytest.mark.timeout(200)
def test_killed_rank_rebuilt_from_tier1_and_survivors_rolled_back():
    got = _run("kill", world=3, group_size=3)
    _check_rebuilt(got, tier=1, step=1)
    assert got[0]["protect_2"] is False  # the victim died before step 2 was protected: everyone rolls back to 1
    assert got[0]["failure_seen"] and got[2]["failure_seen"]
    assert got[1]["report"]["bytes_decoded"] == sum(t.numel() * t.element_size() for t in _state(1))
    # memory: parity per rank is about 1/(k-1) of the local state for k = 3
    for r in (0, 2):
        assert got[r]["parity_bytes_per_rank"] * 2 >= got[r]["state_bytes"]


@pytest.mark.timeout(200)
def test_whole_group_killed_rebuilt_from_tier2():
    got = _run("group", world=4, group_size=2, tier2=1)
    _check_rebuilt(got, tier=2, step=1)
    assert got[2]["report"]["lost"] == [2, 3]


@pytest.mark.timeout(200)
def test_flipped_bit_and_zeroed_rank_repaired_in_place():
    got = _run("corrupt", world=3, group_size=3)
    assert got[2]["mismatched"] == 1 and got[0]["mismatched"] == 0
    assert all(out["repaired_bit"] for out in got.values())
    for out in got.values():
        assert out["report_zeroed"]["tier"] == 1 and out["report_zeroed"]["step"] == 1
    _check_rebuilt(got, tier=1, step=1)
    # rank 2's stripe is parity rank 1's rebuild needs: without it, every rank refuses rather than decode garbage
    assert all("no step boundary is protected on every survivor" in out["stripe_missing"] for out in got.values())
