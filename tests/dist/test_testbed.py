"""The emulated network (root only): teardown leaves nothing behind, `dtk bench comm` on it under a congested
path, and DDP training whose path gets congested at a step: the plan changes within a few steps, the losses
stay those of the native run, and the events name the link."""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dtk.testbed.net import STATE_DIR, Testbed, namespaces, sh, unavailable_reason
from tests.conftest import ROOT, dtk_env

pytestmark = [pytest.mark.dist,
              pytest.mark.skipif(unavailable_reason() is not None, reason=f"test bed: {unavailable_reason()}")]


def leftovers(tag: str) -> list[str]:
    """Anything of test bed `tag` still on the machine: namespaces, the root link, the state file."""
    out = [ns for ns in namespaces() if ns.startswith(f"dtk{tag}")]
    if sh("ip", "link", "show", f"dtk{tag}", check=False).returncode == 0:
        out.append(f"link dtk{tag}")
    if (STATE_DIR / f"{tag}.json").exists():
        out.append("state file")
    return out


@pytest.mark.timeout(60)
def test_teardown_leaves_no_namespace_qdisc_or_process_also_on_failure():
    from dtk.testbed import shape

    bed = Testbed(n=3, tag=f"t{os.getpid() % 100000}")
    sleeper = None
    with pytest.raises(RuntimeError, match="a test failing inside"):
        with bed:
            shape.apply(bed, [shape.parse("pair=0-1,rate=100mbit"), shape.parse("host=2,rate=100mbit")])
            assert len(shape.qdiscs(bed)) == 4  # two pair ends, host 2 both ways
            prefix, env = bed.spawn_prefix(1)
            sleeper = subprocess.Popen([*prefix, "sleep", "600"], env={**os.environ, **env})
            deadline = time.monotonic() + 10
            while not sh("ip", "netns", "pids", bed.host(1)).stdout.split() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert sh("ip", "netns", "exec", bed.host(0), "ip", "-4", "addr", "show", "eth0").stdout.count(bed.ip(0)) == 1
            raise RuntimeError("a test failing inside the test bed")
    assert sleeper.wait(timeout=10) == -9  # killed: a namespace cannot go while a process is inside it
    assert leftovers(bed.tag) == []


@pytest.mark.timeout(300)
def test_bench_on_a_congested_path_changes_the_ring_and_cleans_up(tmp_path):
    out = tmp_path / "bench"
    p = subprocess.Popen([sys.executable, "-m", "dtk.cli", "bench", "comm", "--testbed", "4",
                          "--congest", "pair=0-1,rate=100mbit", "--comm", "native,adaptive", "--ops",
                          "all_reduce,all_gather", "--min-bytes", "1M", "--max-bytes", "1M", "--iters", "1",
                          "--warmup", "1", "--out", str(out)], env=dtk_env(), cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = p.communicate(timeout=280)
    assert p.returncode == 0, stderr[-3000:]
    assert leftovers(f"p{p.pid}") == []
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert {(r["comm"], r["kind"]) for r in rows} == {(c, k) for c in ("native", "adaptive")
                                                     for k in ("all_reduce", "all_gather")}
    for r in rows:
        assert set(r) >= {"comm", "kind", "size_bytes", "algbw_gbps", "busbw_gbps"} and r["size_bytes"] == 1 << 20
        if r["comm"] == "adaptive":
            assert r["plan"].startswith("ring order")
            order = [int(x) for x in r["plan"].split()[-1].split("-")]
            assert {frozenset((order[k], order[(k + 1) % 4])) for k in range(4)}.isdisjoint({frozenset((0, 1))})
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert events and events[0]["event"] == "comm_plan"
    # the shaped path is the slowest link found (on a loaded machine healthy links may read slow too)
    assert min(events[0]["congested_links"], key=lambda c: c["bytes_per_s"])["link"] == "0-1"


# -- training on the test bed, the path 0-1 congested after step CONGEST_AT --------------------------------------

STEPS, CONGEST_AT = 14, 4


def _train_rank(rank: int, n: int, port: int, queue, bed_state, flags: str) -> None:
    bed = Testbed(n=n, tag=bed_state["tag"], subnet=tuple(bed_state["subnet"]))
    bed.enter(rank)
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dtk.comm.dispatch import step_boundary
    from dtk.comm.group import Seam, register

    torch.set_num_threads(1)
    store = dist.TCPStore(bed.root_ip, port, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore("w", store), rank=rank, world_size=n)
    register()
    models, groups = {}, {}
    for mode in ("native", "adaptive"):
        Seam.comm_mode = mode
        groups[mode] = dist.new_group(backend="dtk")
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 64))  # 0.5 MB grads
        models[mode] = (DDP(net, process_group=groups[mode], bucket_cap_mb=1),
                        torch.optim.SGD(net.parameters(), lr=0.05))
    losses = {m: [] for m in models}
    events = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)
        for mode, (model, opt) in models.items():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses[mode].append(float(mean) / n)
        events += [{**e, "after_step": step} for e in step_boundary(step)]
        if step == CONGEST_AT and rank == 0:  # ask the launcher side to congest the path, wait until it has
            Path(flags, "congest").touch()
            while not Path(flags, "congested").exists():
                time.sleep(0.02)
        dist.barrier()
    if rank == 0:
        queue.put({"losses": losses, "events": events})
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_ddp_with_a_path_congested_at_a_step_replans_and_keeps_the_losses(tmp_path):
    from dtk.bench import spawn_ranks
    from dtk.testbed import shape

    def congest_when_asked(bed, stop):
        while not stop.is_set():
            if (tmp_path / "congest").exists():
                shape.apply(bed, [shape.parse("pair=0-1,rate=100mbit")])  # the launcher's side, not a rank
                (tmp_path / "congested").touch()
                return
            time.sleep(0.02)

    with Testbed(n=4, tag=f"d{os.getpid() % 100000}") as bed:
        stop = threading.Event()
        watcher = threading.Thread(target=congest_when_asked, args=(bed, stop), daemon=True)
        watcher.start()
        try:
            result = spawn_ranks(_train_rank, nproc=4, args=({"tag": bed.tag, "subnet": bed.subnet}, str(tmp_path)),
                                 timeout_s=280)
        finally:
            stop.set()
    assert leftovers(bed.tag) == []
    native, adaptive = result["losses"]["native"], result["losses"]["adaptive"]
    assert adaptive == pytest.approx(native, rel=1e-6)
    # On a loaded machine a stalled probe before the congestion can already change the plan (and a periodic
    # recheck can be what sees the congestion first): what matters is the first change after it.
    changes = [e for e in result["events"] if e["event"] == "comm_plan" and "all_reduce" in e["changed"]
               and e["after_step"] > CONGEST_AT]
    assert changes, result["events"]
    first = changes[0]
    assert first["after_step"] <= CONGEST_AT + 3  # within a few steps of the congestion
    assert "0-1" in [c["link"] for c in first["congested_links"]]
    assert first["reason"] in ("native collective slowed", "recheck")
    assert first["after"]["all_reduce"].startswith("ring order")
