"""`dtk bench comm`, an app over the comm layer (not part of it): an nccl-tests-like sweep over local ranks, the
native gloo group and dtk's seam side by side (time, algbw, busbw per size and collective, measured in the same
processes, alternating which goes first); and `spawn_ranks`, the local-rank starter that probes and tests share."""
from __future__ import annotations

import datetime
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from dtk.comm.seam import bus_factor
from dtk.errors import DtkError
from dtk.sizes import human_size

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "reduce", "broadcast")
NCCL_TESTS_BUS = {"reduce": 1.0, "broadcast": 1.0}
"""busbw / algbw where nccl-tests' factor differs from the seam's byte count (which counts a reduce at the ring's
(n-1)/n)."""


def _bus(kind: str, n: int) -> float:
    return NCCL_TESTS_BUS.get(kind, bus_factor(kind, n))


def _ops(dist, full, part, nproc: int) -> dict:
    """One call of each collective on group g; reduce and broadcast take each rank as root in turn (ZeRO-1/2
    reduce each gradient partition to its owner): with --iters a multiple of the ranks, each root weighs the same."""
    import itertools

    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    roots: dict = {}

    def root(kind: str, g) -> int:  # one cycle per group: every mode sees the same roots in the same order
        return next(roots.setdefault((kind, id(g)), itertools.cycle(range(nproc))))

    return {"all_reduce": lambda g: dist.all_reduce(full, group=g),
            "all_gather": lambda g: all_gather(full, part, group=g),
            "reduce_scatter": lambda g: reduce_scatter(part, full, group=g),
            "reduce": lambda g: dist.reduce(full, dst=root("reduce", g), group=g),
            "broadcast": lambda g: dist.broadcast(full, src=root("broadcast", g), group=g)}


def sizes(min_bytes: int, max_bytes: int) -> list[int]:
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= 2
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target, *, nproc: int, args: tuple = (), timeout_s: float = 1800) -> Any:
    """Run `target(rank, nproc, store_port, queue, *args)` in `nproc` fresh processes on a TCPStore hosted here;
    returns what rank 0 put on the queue. A rank that fails stops the others and raises."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=target, args=(rank, nproc, port, queue, *args), daemon=True) for rank in range(nproc)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    result = None
    try:
        while True:
            if not queue.empty():
                result = queue.get()
            codes = [p.exitcode for p in procs]
            if any(c not in (None, 0) for c in codes):
                raise RuntimeError(f"a rank failed: exit codes {codes}")
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks still running after {timeout_s:.0f}s")
            time.sleep(0.05)
        while result is None and not queue.empty():
            result = queue.get()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        del store
    return result


def _timed(op, iters: int, group, native) -> float:
    """Seconds per op: `iters` back-to-back calls after a barrier; the slowest rank's time (as the op ends there)."""
    import torch
    import torch.distributed as dist

    dist.barrier(group=native)
    t0 = time.perf_counter()
    for _ in range(iters):
        op(group)
    elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=native)
    return float(elapsed)


def _sweep_rank(rank: int, nproc: int, port: int, queue, kinds, byte_sizes, iters: int, warmup: int) -> None:
    import torch
    import torch.distributed as dist

    from dtk.comm.group import Seam, register

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=dist.PrefixStore("bench", store), rank=rank, world_size=nproc)
    register()
    groups = {"native": dist.group.WORLD, "seam": dist.new_group(backend="dtk")}
    rows = []
    for i, size in enumerate(byte_sizes):
        count = max(nproc, size // 4 // nproc * nproc)  # float32 elements, divisible into n equal chunks
        full = torch.ones(count)
        part = torch.ones(count // nproc)
        ops = _ops(dist, full, part, nproc)
        # alternate which backend goes first, so the machine's noise does not always favour one
        order = ("native", "seam") if i % 2 == 0 else ("seam", "native")
        for kind in kinds:
            row = {"op": kind, "size_bytes": count * 4, "count": count, "nproc": nproc}
            for name in order:
                for _ in range(warmup):
                    ops[kind](groups[name])
                Seam.stats.take()
                seconds = _timed(ops[kind], iters, groups[name], groups["native"])
                algbw = row["size_bytes"] / seconds / 1e9
                row[name] = {"time_s": seconds, "algbw_gbps": algbw, "busbw_gbps": algbw * _bus(kind, nproc)}
                if name == "seam":  # what the seam counted per call: nccl-tests' size, if it counts right
                    stats = Seam.stats.take()["by_kind"].get(kind, {"calls": 0, "size_bytes": 0})
                    row["seam_counted_size_bytes"] = stats["size_bytes"] / max(stats["calls"], 1)
            row["seam_over_native_algbw"] = row["seam"]["algbw_gbps"] / row["native"]["algbw_gbps"]
            rows.append(row)
    dist.barrier()
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def print_table(rows: list[dict], *, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("size", "op", "native us", "algbw GB/s", "busbw GB/s", "seam us", "algbw GB/s", "busbw GB/s",
                "seam/native"):
        table.add_column(col, justify="left" if col == "op" else "right")
    for r in rows:
        n, s = r["native"], r["seam"]
        table.add_row(human_size(r["size_bytes"]), r["op"],
                      f"{n['time_s'] * 1e6:,.0f}", f"{n['algbw_gbps']:.3f}", f"{n['busbw_gbps']:.3f}",
                      f"{s['time_s'] * 1e6:,.0f}", f"{s['algbw_gbps']:.3f}", f"{s['busbw_gbps']:.3f}",
                      f"{r['seam_over_native_algbw']:.2f}x")
    Console(width=None if sys.stdout.isatty() else 140).print(table)


def run_sweep(*, nproc: int, kinds: list[str], min_bytes: int, max_bytes: int, iters: int, warmup: int,
              json_out: str | None = None, show: bool = True) -> list[dict]:
    """Sweep sizes min..max (doubling) for each collective in `kinds` on `nproc` local gloo ranks, native and
    through the seam; print the table, write the rows to `json_out` if given, and return them."""
    if min_bytes > max_bytes:
        raise DtkError(f"--min-bytes: got {min_bytes} bytes, above --max-bytes ({max_bytes}); accepted: min <= max")
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise DtkError(f"--ops: got {bad[0] if bad else 'nothing'!r}; accepted: {', '.join(KINDS)}")
    if json_out:
        try:
            Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DtkError(f"--json: got '{json_out}'; cannot create its folder ({e.strerror})") from None
    byte_sizes = sizes(min_bytes, max_bytes)
    rows = spawn_ranks(_sweep_rank, nproc=nproc, args=(list(kinds), byte_sizes, iters, warmup))
    if show:
        print_table(rows, title=f"collectives on {nproc} local ranks, gloo: native vs dtk seam "
                                f"({iters} iters after {warmup} warm-up)")
    if json_out:
        meta = {"nproc": nproc, "backend": "gloo", "iters": iters, "warmup": warmup,
                "time": "mean seconds per op over iters, slowest rank",
                "units": {"algbw_gbps": "1e9 bytes/s", "size_bytes": "nccl-tests size"}}
        Path(json_out).write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    return rows


# -- comm modes side by side: native vs adaptive, locally or on the test bed under congestion --------------------

MODES = ("native", "adaptive")


def _modes_rank(rank: int, nproc: int, port: int, queue, kinds, byte_sizes, iters: int, warmup: int, modes,
                bed_state) -> None:
    import os

    if bed_state is not None:  # before torch starts threads: every thread it starts inherits the namespace
        from dtk.testbed.net import Testbed

        bed = Testbed(n=nproc, tag=bed_state["tag"], subnet=tuple(bed_state["subnet"]))
        bed.enter(rank)
        host = bed.root_ip
    else:
        host = "127.0.0.1"
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    import torch
    import torch.distributed as dist

    from dtk.comm.group import Seam, register

    torch.set_num_threads(1)
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=dist.PrefixStore("bench", store), rank=rank, world_size=nproc)
    register()
    groups, routers = {}, {}
    for mode in modes:
        Seam.comm_mode = mode
        groups[mode] = dist.new_group(backend="dtk")
        routers[mode] = Seam.groups[-1].router
    native = dist.group.WORLD
    events: list[dict] = []
    rows = []
    t_start = time.time()
    for i, size in enumerate(byte_sizes):
        count = max(nproc, size // 4 // nproc * nproc)
        full = torch.ones(count)
        part = torch.ones(count // nproc)
        ops = _ops(dist, full, part, nproc)
        order = list(modes) if i % 2 == 0 else list(reversed(modes))
        for kind in kinds:
            for mode in order:
                for _ in range(warmup):
                    ops[kind](groups[mode])
                router = routers[mode]
                if router is not None:  # a step boundary: the planner may probe and change the plan here
                    for e in router.boundary(step=i):
                        events.append({**e, "bench_size_bytes": count * 4, "bench_kind": kind})
                seconds = _timed(ops[kind], iters, groups[mode], native)
                algbw = count * 4 / seconds / 1e9
                plan = router.state.plan[kind].describe() if router is not None else "native"
                rows.append({"comm": mode, "kind": kind, "size_bytes": count * 4, "time_s": seconds,
                             "algbw_gbps": algbw, "busbw_gbps": algbw * _bus(kind, nproc), "plan": plan})
    dist.barrier()
    if rank == 0:
        queue.put({"rows": rows, "events": events, "seconds": time.time() - t_start})
    dist.destroy_process_group()


def run_modes(*, nproc: int, kinds: list[str], min_bytes: int, max_bytes: int, iters: int, warmup: int,
              modes: list[str], out_dir: str | None, testbed: int = 0, congest: Sequence[str] = (),
              show: bool = True) -> list[dict]:
    """The sweep for each comm mode (native, adaptive) in the same ranks, on local ranks or on a test bed of
    `testbed` hosts under `congest`; writes out_dir/bench.json (rows) and out_dir/events.jsonl (plan changes)."""
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise DtkError(f"--comm: got {bad[0] if bad else 'nothing'!r}; accepted: a comma list of {', '.join(MODES)}")
    if congest and not testbed:
        raise DtkError(f"--congest: got {congest[0]!r} without --testbed; congestion needs the test bed (--testbed N)")
    if min_bytes > max_bytes:
        raise DtkError(f"--min-bytes: got {min_bytes} bytes, above --max-bytes ({max_bytes}); accepted: min <= max")
    out = Path(out_dir) if out_dir else None
    if out is not None:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DtkError(f"--out: got '{out_dir}'; cannot create it ({e.strerror})") from None
    byte_sizes = sizes(min_bytes, max_bytes)
    args = (list(kinds), byte_sizes, iters, warmup, list(modes))
    if testbed:
        from dtk.testbed import shape
        from dtk.testbed.net import Testbed, check_environment

        check_environment()
        specs = [shape.parse(c, hosts=testbed) for c in congest]
        nproc = testbed
        with Testbed(n=testbed) as bed:
            shape.apply(bed, specs)
            result = spawn_ranks(_modes_rank, nproc=nproc, args=(*args, {"tag": bed.tag, "subnet": bed.subnet}))
    else:
        result = spawn_ranks(_modes_rank, nproc=nproc, args=(*args, None))
    rows = result["rows"]
    where = f"test bed of {testbed} hosts" + (f", congested: {'; '.join(congest)}" if congest else ", unshaped") \
        if testbed else f"{nproc} local ranks"
    if show:
        _print_modes(rows, modes, title=f"comm modes on a {where} ({iters} iters after {warmup} warm-up)")
    if out is not None:
        meta = {"nproc": nproc, "testbed": testbed, "congest": list(congest), "iters": iters, "warmup": warmup,
                "time": "mean seconds per op over iters, slowest rank", "units": {"algbw_gbps": "1e9 bytes/s"}}
        (out / "bench.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
        (out / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in result["events"]))
    return rows


def _print_modes(rows: list[dict], modes, *, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    cols = ["size", "op"] + [c for m in modes for c in (f"{m} algbw GB/s",)] + (
        ["adaptive/native", "adaptive plan"] if set(modes) == set(MODES) else [])
    for col in cols:
        table.add_column(col, justify="left" if col in ("op", "adaptive plan") else "right")
    by = {(r["kind"], r["size_bytes"], r["comm"]): r for r in rows}
    for kind, size in dict.fromkeys((r["kind"], r["size_bytes"]) for r in rows):
        cells = [human_size(size), kind] + [f"{by[(kind, size, m)]['algbw_gbps']:.4f}" for m in modes]
        if set(modes) == set(MODES):
            a, n = by[(kind, size, "adaptive")], by[(kind, size, "native")]
            cells += [f"{a['algbw_gbps'] / n['algbw_gbps']:.2f}x", a["plan"]]
        table.add_row(*cells)
    Console(width=None if sys.stdout.isatty() else 160).print(table)
