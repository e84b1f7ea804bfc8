"""`dtk probe`: bandwidth and latency between every pair of hosts, as a table and JSON, so a slow link shows before
a run trains on it. One prober per host: on dtk's test bed (one per emulated host), or on real hosts at a TCPStore."""
from __future__ import annotations

import datetime
import json
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from dtk.errors import DtkError
from dtk.resilience import protocol as keys

PROBE_BYTES = 4 << 20
"""Bytes each side sends per pass: 16 x the shapers' 256 KB burst, so a shaped link shows its rate (0.17 s at
200 mbit), and enough on an unshaped link to be more than the latency."""
PASSES = 3
"""Transfers per pair; the best counts (a loaded machine can stall one pass; a stall only ever lowers a rate)."""
PINGS = 20
"""Round trips of 4 bytes per pair; the median is the latency."""
PING_TAG = 3 << 28
"""Tags of the ping-pongs (the bandwidth probe, dtk.comm.monitor, uses 1 << 30 and up)."""


# -- on every host ---------------------------------------------------------------------------------------------------

def ping_pong(pg, *, rank: int, size: int, pings: int) -> tuple[list[float], list[float]]:
    """Median and least round-trip seconds to every peer: 4-byte ping-pongs, one peer at a time (the monitor's
    tournament rounds); the lower rank of a pair pings, the higher answers. On a loaded machine a round trip waits
    for a CPU now and then (one 4 ms scheduler tick here): the least is the path, the median what a step sees."""
    import torch

    from dtk.comm.monitor import tournament

    rtt, least = [math.nan] * size, [math.nan] * size
    out, back = torch.zeros(1), torch.empty(1)
    for r, pairs in enumerate(tournament(size)):
        peer = next((b if a == rank else a for a, b in pairs if rank in (a, b)), None)
        if peer is None:
            continue
        tag = PING_TAG + r
        times = []
        for k in range(pings + 2):  # two warm-up round trips
            t0 = time.perf_counter()
            if rank < peer:
                pg.send([out], peer, tag).wait()
                pg.recv([back], peer, tag).wait()
            else:
                pg.recv([back], peer, tag).wait()
                pg.send([out], peer, tag).wait()
            if k >= 2 and rank < peer:
                times.append(time.perf_counter() - t0)
        if rank < peer:
            rtt[peer], least[peer] = statistics.median(times), min(times)
    return rtt, least


def measure(pg, *, rank: int, size: int, nbytes: int, passes: int, pings: int, me: dict) -> dict | None:
    """Every host calls this; host 0 gets the whole picture (the others None). Bandwidth: the comm planner's own
    probe (dtk.comm.monitor.LinkMonitor.probe, each pair exchanging `nbytes` both ways at once); latency: pings."""
    import torch

    from dtk.comm.monitor import LinkMonitor

    t0 = time.perf_counter()
    bw = LinkMonitor(rank=rank, size=size).probe(pg, nbytes=nbytes, passes=passes, tag_base=1 << 30)
    rtt, least = ping_pong(pg, rank=rank, size=size, pings=pings)
    row = torch.tensor(bw + rtt + least, dtype=torch.float64)
    rows = [torch.empty_like(row) for _ in range(size)]
    pg.allgather([rows], [row]).wait()
    names = torch.zeros(1024, dtype=torch.uint8)  # who each host is: a host name, an address, an interface name
    raw = json.dumps(me).encode()
    assert len(raw) <= 1024, me
    names[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    gathered = [torch.empty_like(names) for _ in range(size)]
    pg.allgather([gathered], [names]).wait()
    hosts = [json.loads(bytes(g.tolist()).rstrip(b"\0").decode()) for g in gathered]
    if rank != 0:
        return None
    matrix = [r.tolist() for r in rows]
    bandwidth = [m[:size] for m in matrix]
    rtts, leasts = [m[size:2 * size] for m in matrix], [m[2 * size:] for m in matrix]
    return summarize(bandwidth, rtts, leasts, hosts=hosts, nbytes=nbytes, passes=passes, pings=pings,
                     seconds=time.perf_counter() - t0)


def summarize(bandwidth: list[list[float]], rtts: list[list[float]], least: list[list[float]], *, hosts: list[dict],
              nbytes: int, passes: int, pings: int, seconds: float) -> dict:
    """The matrices (row i: what host i measured, from column j), one record per link (the slower direction, the
    pinging side's round trip), the slowest link against the median link, and what the comm planner would call
    congested (its own classification, dtk.comm.planner.Links): links, and hosts whose every link is slow."""
    from dtk.comm.planner import CONGESTED, Links

    n = len(bandwidth)
    view = Links([[x if i != j else math.nan for j, x in enumerate(r)] for i, r in enumerate(bandwidth)])
    slow_hosts = [h for h in range(n) if n > 2 and view.cap[h] < CONGESTED * max(view.cap)]
    links: list[dict[str, Any]] = []
    for i in range(n):
        for j in range(i + 1, n):
            rate = min(_v(bandwidth[i][j]), _v(bandwidth[j][i]))
            links.append({"link": f"{i}-{j}", "bytes_per_s": rate if math.isfinite(rate) else None,
                          "rtt_us": _us(rtts[i][j]), "rtt_min_us": _us(least[i][j])})
    measured = [x["bytes_per_s"] for x in links if x["bytes_per_s"]]
    median = statistics.median(measured) if measured else None
    slowest = min((x for x in links if x["bytes_per_s"]), key=lambda x: x["bytes_per_s"], default=None)
    return {
        "hosts": hosts, "bytes": nbytes, "passes": passes, "pings": pings, "probe_seconds": round(seconds, 3),
        "bandwidth_bytes_per_s": [[_clean(x) if i != j else None for j, x in enumerate(r)] for i, r in enumerate(bandwidth)],
        "rtt_us": [[_us(rtts[min(i, j)][max(i, j)]) if i != j else None for j in range(n)] for i in range(n)],
        "rtt_min_us": [[_us(least[min(i, j)][max(i, j)]) if i != j else None for j in range(n)] for i in range(n)],
        "links": links, "median_bytes_per_s": median,
        "congested_links": [f"{i}-{j}" for i, j, _ in view.congested], "slow_hosts": slow_hosts,
        "slowest": None if slowest is None else {**slowest, "below_median": median / slowest["bytes_per_s"]},
        "units": {"bytes_per_s": "bytes received per second while both ends send (best of passes)",
                  "rtt_us": "median round trip of a 4-byte message, microseconds",
                  "rtt_min_us": "least round trip of a 4-byte message, microseconds"},
    }


def _v(x: float) -> float:
    return x if x == x and x > 0 else math.inf


def _clean(x: float) -> float | None:
    return x if x == x and x > 0 else None


def _us(seconds: float) -> float | None:
    return round(seconds * 1e6, 1) if seconds == seconds else None


def slowest_line(result: dict) -> str:
    s = result["slowest"]
    if s is None:
        return "slowest link: none measured"
    if len(result["links"]) == 1:
        return f"slowest link: {s['link']} at {s['bytes_per_s'] / 1e6:,.1f} MB/s (the only link)"
    line = (f"slowest link: {s['link']} at {s['bytes_per_s'] / 1e6:,.1f} MB/s, {s['below_median']:.1f}x below the "
            f"median ({result['median_bytes_per_s'] / 1e6:,.1f} MB/s)")
    if result.get("slow_hosts"):  # every link of a host is slow: its own link, not one path
        line += f"; slow host: {', '.join(map(str, result['slow_hosts']))} (all of its links)"
    return line


def print_table(result: dict, *, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    n = len(result["hosts"])
    slow = result["slowest"]["link"] if result["slowest"] and len(result["links"]) > 1 else None
    table = Table(title=title, caption="cell: MB/s received by the row's host from the column's (both sending); "
                                       "round trip in µs, median (least)")
    table.add_column("host", justify="left")
    for j in range(n):
        table.add_column(str(j), justify="right")
    for i, h in enumerate(result["hosts"]):
        cells = []
        for j in range(n):
            bw, rtt, least = (result[k][i][j] for k in ("bandwidth_bytes_per_s", "rtt_us", "rtt_min_us"))
            if i == j:
                cells.append("-")
                continue
            text = f"{bw / 1e6:,.1f} MB/s, {rtt:,.0f} µs ({least:,.0f})" if bw and rtt is not None else "?"
            cells.append(f"[red]{text}[/]" if slow == f"{min(i, j)}-{max(i, j)}" else text)
        table.add_row(f"{i} {h.get('name', '')} {h.get('address', '')}".strip(), *cells)
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def write_json(result: dict, path: str) -> None:
    Path(path).write_text(json.dumps(result, indent=1) + "\n")


def _check_json_path(path: str | None) -> None:
    if path is None:
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DtkError(f"--json: got '{path}'; cannot create its folder ({e.strerror})") from None


# -- on the test bed: one prober process per emulated host -----------------------------------------------------------

def _bed_rank(rank: int, n: int, port: int, queue, bed_state: dict, nbytes: int, passes: int, pings: int,
              timeout_s: float) -> None:
    from dtk.testbed.net import IFNAME, Testbed

    bed = Testbed(n=n, tag=bed_state["tag"], subnet=tuple(bed_state["subnet"]))
    bed.enter(rank)  # before torch starts threads: every thread it starts inherits the namespace
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(bed.root_ip, port, is_master=False, timeout=timeout)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("probe", store), rank, n, timeout)
    result = measure(pg, rank=rank, size=n, nbytes=nbytes, passes=passes, pings=pings,
                     me={"name": bed.host(rank), "address": bed.ip(rank), "interface": IFNAME})
    if rank == 0:
        queue.put(result)


def run_testbed(*, hosts: int, congest: list[str], nbytes: int = PROBE_BYTES, passes: int = PASSES,
                pings: int = PINGS, json_out: str | None = None, timeout_s: float = 120, show: bool = True) -> dict:
    """Bring up a test bed of `hosts` hosts, congested as `congest` says, probe it, tear it down (always)."""
    from dtk.bench import spawn_ranks
    from dtk.testbed import shape
    from dtk.testbed.net import Testbed, check_environment

    if hosts < 2:
        raise DtkError(f"--testbed: got {hosts}; accepted: 2..64 hosts")
    check_environment()
    specs = [shape.parse(c, hosts=hosts) for c in congest]
    _check_json_path(json_out)
    with Testbed(n=hosts) as bed:
        shape.apply(bed, specs)
        result = spawn_ranks(_bed_rank, nproc=hosts, timeout_s=timeout_s + 60,
                             args=({"tag": bed.tag, "subnet": bed.subnet}, nbytes, passes, pings, timeout_s))
    result.update(mode="testbed", congest=list(congest))
    where = f"test bed of {hosts} hosts, " + (f"congested: {'; '.join(congest)}" if congest else "unshaped")
    _report(result, title=f"dtk probe: {where} ({human(nbytes)} x {passes} passes, {pings} pings per link)",
            json_out=json_out, show=show)
    return result


# -- on real hosts: one `dtk probe` per host, meeting at node 0's TCPStore ------------------------------------------

def run_hosts(*, hosts: int, endpoint: str, node_rank: int, interface: str | None = None,
              nbytes: int = PROBE_BYTES, passes: int = PASSES, pings: int = PINGS, json_out: str | None = None,
              timeout_s: float = 120, show: bool = True) -> dict | None:
    """This host's part of a probe of `hosts` hosts; node 0 hosts the store at `endpoint`, prints the table and
    writes the JSON. The inner backend binds as `dtk train` would (world.interface's rules, dtk.netif)."""
    from dtk import netif

    if hosts < 2:
        raise DtkError(f"--hosts: got {hosts}; accepted: 2 or more (one `dtk probe` per host)")
    if not 0 <= node_rank < hosts:
        raise DtkError(f"--node-rank: got {node_rank}; accepted: 0..{hosts - 1} (--hosts is {hosts})")
    _check_json_path(json_out)
    bind = netif.backend_env(interface, endpoint=endpoint, multi_node=True)
    os.environ.update(bind)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    host, _, port = endpoint.rpartition(":")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host.strip("[]"), int(port), is_master=node_rank == 0, wait_for_workers=False,
                              timeout=timeout)
    except (RuntimeError, OSError) as e:  # DistNetworkError is a RuntimeError
        raise DtkError(f"--rdzv-endpoint: got {endpoint}; cannot {'listen' if node_rank == 0 else 'connect'} there "
                       f"({str(e).splitlines()[0][:120]})") from None
    kv = dist.PrefixStore("probe", store)
    kv.set(keys.joined(node_rank), socket.gethostname())
    t0 = time.monotonic()
    while not all(kv.check([keys.joined(k)]) for k in range(hosts)):  # name the missing hosts, not a gloo timeout
        if time.monotonic() - t0 > timeout_s:
            missing = [str(k) for k in range(hosts) if not kv.check([keys.joined(k)])]
            raise DtkError(f"--hosts: got {hosts}; host(s) {', '.join(missing)} did not join at {endpoint} within "
                           f"--timeout {timeout_s:g}s")
        time.sleep(0.05)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo", kv), node_rank, hosts, timeout)
    address = netif.route_source(host.strip("[]"), int(port))
    result = measure(pg, rank=node_rank, size=hosts, nbytes=nbytes, passes=passes, pings=pings,
                     me={"name": socket.gethostname(), "address": address,
                         "interface": bind.get("GLOO_SOCKET_IFNAME") or os.environ.get("GLOO_SOCKET_IFNAME")})
    # node 0's store must outlive every host's last read; torch's Backend stub (ProcessGroupGloo's) lacks barrier
    pg.barrier().wait()  # type: ignore[attr-defined]
    if node_rank != 0:
        print(f"node {node_rank}: probed; the table is on node 0", flush=True)
        return None
    assert result is not None  # host 0 gets the whole picture
    result.update(mode="hosts", endpoint=endpoint, congest=[])
    _report(result, title=f"dtk probe: {hosts} hosts at {endpoint} ({human(nbytes)} x {passes} passes, "
                          f"{pings} pings per link)", json_out=json_out, show=show)
    return result


def _report(result: dict, *, title: str, json_out: str | None, show: bool) -> None:
    if show:
        print_table(result, title=title)
        print(slowest_line(result), flush=True)
    if json_out:
        write_json(result, json_out)
        if show:
            print(f"written: {json_out}", flush=True)


def human(n: int) -> str:
    from dtk.sizes import human_size

    return human_size(n) + "B"
