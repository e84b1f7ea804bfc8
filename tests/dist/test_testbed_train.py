"""`dtk train --testbed H` and `dtk compare --testbed H` (root only): one launcher per emulated host, the losses of
the same run on one host, congestion as a fault at a step that the adaptive comm layer routes around, and a test
bed that is gone afterwards also when the run fails or is interrupted."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtk.resilience import nodes
from dtk.testbed.net import namespaces, unavailable_reason
from tests.conftest import RECIPES, ROOT, TINY, dtk_env, losses, read_jsonl

pytestmark = [pytest.mark.dist,
              pytest.mark.skipif(unavailable_reason() is not None, reason=f"test bed: {unavailable_reason()}")]


def start_dtk(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dtk.cli", *map(str, args)], env=dtk_env(), cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def bed_left_behind(driver_pid: int) -> list[str]:
    """The namespaces of the test bed a `dtk ... --testbed` process made (tagged with its pid) still on the machine."""
    return [ns for ns in namespaces() if ns.startswith(f"dtkp{driver_pid}")]


def run_dtk_on_bed(*args: str, timeout: float) -> tuple[subprocess.CompletedProcess, list[str]]:
    p = start_dtk(*args)
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err), bed_left_behind(p.pid)


@pytest.mark.timeout(200)
def test_two_hosts_of_two_ranks_train_exactly_as_one_host_of_four(tmp_path, reference_losses):
    run_dir = tmp_path / "bed"
    p, left = run_dtk_on_bed("train", RECIPES / "quickstart.yaml", *TINY, "training.steps=6", f"output.dir={run_dir}",
                             "--testbed", "2", "--no-progress", timeout=170)
    assert p.returncode == 0, p.stderr[-3000:]
    assert left == []
    assert p.stdout.count("done: 6 steps") == 1, p.stdout  # node 0's result line; node 1's output went to its log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["status"] == "completed"
    node1 = json.loads((run_dir / "summary-node1.json").read_text())
    assert node1["status"] == "completed"
    assert set(json.loads((run_dir / "ranks.json").read_text())["ranks"]) == {"0", "1"}
    assert set(json.loads((run_dir / "ranks-node1.json").read_text())["ranks"]) == {"2", "3"}
    assert "node 1: done" in (run_dir / "logs" / "launcher1.log").read_text()
    [up] = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "test bed up"]
    assert up["hosts"] == 2 and up["ranks_per_host"] == 2

    # same ranks, same data, same sums: bit for bit
    assert summary["losses"] == reference_losses("world.nproc=4", "training.steps=6")


@pytest.mark.timeout(300)
def test_compare_on_a_path_congested_at_a_step_adaptive_routes_around_it_with_native_losses(tmp_path):
    out = tmp_path / "cmp"
    # the quickstart GPT's 1.7 MB of gradients: one all-reduce that a 100 mbit path slows ~10x
    p, left = run_dtk_on_bed("compare", RECIPES / "quickstart.yaml", "data.seq_len=16", "training.micro_batch=4",
                             "world.nproc=1", "training.steps=10", "--testbed", "4",
                             "--variant", "native:comm.mode=native", "--variant", "adaptive:comm.mode=adaptive",
                             "--fault", "congest:pair=0-1,rate=100mbit,step=4", "--assert-parity", "1e-6",
                             "--out", out, "--no-progress", timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert left == []
    result = json.loads((out / "compare.json").read_text())
    assert result["faults"] == ["congest:pair=0-1,rate=100mbit,step=4"]
    native, adaptive = (v for v in result["variants"])
    assert adaptive["losses"] == pytest.approx(native["losses"], rel=1e-6) and len(native["losses"]) == 10
    for v in (native, adaptive):
        [c] = [e for e in read_jsonl(Path(v["run_dir"]) / "events.jsonl") if e["event"] == "congestion"]
        assert c["spec"] == "pair=0-1,rate=100mbit" and c["step"] == 4  # rank 0 waited at step 4 for the shaping
    events = read_jsonl(out / "adaptive" / "events.jsonl")
    [congested] = [e for e in events if e["event"] == "congestion"]
    changes = [e for e in events if e["event"] == "comm_plan" and e["time"] > congested["time"]
               and "all_reduce" in e["changed"]]
    assert changes, events
    first = changes[0]
    assert 4 < first["step"] <= 4 + 3  # within a few steps of the congestion
    # the shaped path is the slowest link found (on a loaded machine healthy links may read slow too)
    assert min(first["congested_links"], key=lambda c: c["bytes_per_s"])["link"] == "0-1"
    order = [int(x) for x in first["after"]["all_reduce"].removeprefix("ring order ").split("-")]
    assert {frozenset((order[k], order[(k + 1) % 4])) for k in range(4)}.isdisjoint({frozenset((0, 1))})


@pytest.mark.timeout(200)
def test_the_bed_is_torn_down_when_a_rank_on_another_host_fails_and_on_ctrl_c(tmp_path):
    failed = tmp_path / "failed"
    p, left = run_dtk_on_bed("train", RECIPES / "quickstart.yaml", *TINY, "training.steps=30", f"output.dir={failed}",
                             "--testbed", "2", "--fault", "kill:rank=3,step=2", "--no-progress", timeout=170)
    assert p.returncode == 1, p.stderr[-3000:]
    assert left == []
    # node 1's launcher saw its rank die and stopped the run everywhere; node 0 says so
    assert "error: node 1 stopped the run" in p.stderr and "rank 3 failed (kill)" in p.stderr
    summary = json.loads((failed / "summary.json").read_text())
    assert summary["status"] == "failed" and [f["rank"] for f in summary["failures"]] == [3]

    interrupted = tmp_path / "interrupted"
    driver = start_dtk("train", RECIPES / "quickstart.yaml", *TINY, "training.steps=100000",
                       f"output.dir={interrupted}", "--testbed", "2", "--no-progress")
    deadline = time.monotonic() + 120
    while not ((interrupted / "metrics.jsonl").exists() and losses(interrupted)):  # training, on both hosts
        assert driver.poll() is None and time.monotonic() < deadline, driver.stderr.read()[-3000:]
        time.sleep(0.2)
    driver.send_signal(signal.SIGINT)
    out, err = driver.communicate(timeout=60)
    assert driver.returncode == 130, err[-3000:]
    assert bed_left_behind(driver.pid) == []
    assert "interrupted at step" in out
    assert json.loads((interrupted / "summary.json").read_text())["status"] == "interrupted"
    pids = [pid for name in ("ranks.json", "ranks-node1.json")
            for pid in json.loads((interrupted / name).read_text())["ranks"].values()]
    assert len(pids) == 4 and not [pid for pid in pids if Path(f"/proc/{pid}").exists()]


@pytest.mark.timeout(240)
def test_ranks_lost_on_another_host_killed_or_hung_are_recovered_in_place_by_node_0(tmp_path, reference_losses):
    run_dir = tmp_path / "inplace"
    p, left = run_dtk_on_bed("train", RECIPES / "quickstart.yaml", *TINY, "training.steps=10", f"output.dir={run_dir}",
                             "resilience.mode=inplace", "--testbed", "2", "--fault", "kill:rank=3,step=4",
                             "--fault", "hang:rank=2,step=7", "--no-progress", timeout=210)
    assert p.returncode == 0, p.stderr[-3000:]
    assert left == []
    summary = json.loads((run_dir / "summary.json").read_text())
    killed, hung = summary["failures"]
    assert (killed["rank"], killed["fault"], killed["step"]) == (3, "kill", 4)
    # node 1 saw its rank hang (node 0's ranks, waiting on it, were not taken for hung) and reported it
    assert (hung["rank"], hung["fault"], hung["step"], hung["detected_by"]) == (2, "hang", 7, "heartbeat")
    for f in (killed, hung):
        # node 1 replaced its rank at node 0's request, with a shadow of its own (node 1's ids start at 1000)
        [how] = f["replacements"]
        assert how["node"] == 1 and how["replacement"] == "shadow" and how["shadow"] >= 1000
        assert f["steps_lost"] == 0 and f["survivor_engines_kept"] and 0 in f["survivors"] and 1 in f["survivors"]

    # the run after recovery is the run without the failures
    assert summary["losses"] == reference_losses("world.nproc=4", "training.steps=10")


@pytest.mark.timeout(300)
def test_a_host_killed_with_its_launcher_and_shadows_is_rebuilt_on_the_other_host_from_tier_two(tmp_path,
                                                                                                 reference_losses):
    # zero2, parity groups of one host each, one Reed-Solomon shard across the two hosts; at step 5 host 1 goes
    # down: its launcher, both ranks and its shadows are SIGKILLed at once. Node 0 stops hearing host 1, promotes
    # its own shadows to ranks 2 and 3, and their shards come back from host 0's tier 2
    run_dir = tmp_path / "host"
    sharded = ["strategy.name=zero2", "training.steps=10", "resilience.parity_group=2", "resilience.parity_tier2=1"]
    p, left = run_dtk_on_bed("train", RECIPES / "quickstart.yaml", *TINY, *sharded, f"output.dir={run_dir}",
                             "resilience.mode=inplace", "resilience.shadows=2", "--testbed", "2",
                             "--fault", "kill-host:host=1,step=5", "--no-progress", timeout=270)
    assert p.returncode == 0, p.stderr[-3000:]
    assert left == []
    assert [-signal.SIGKILL] == [e["exit_codes"][1] for e in read_jsonl(run_dir / "events.jsonl")
                                 if e["event"] == "launchers ended"]  # host 1's launcher was killed, not stopped
    summary = json.loads((run_dir / "summary.json").read_text())
    by_rank = {f["rank"]: f for f in summary["failures"]}
    assert sorted(by_rank) == [2, 3] and (by_rank[2]["fault"], by_rank[3]["fault"]) == ("kill-host", "host lost")
    for f in by_rank.values():
        assert f["node_lost"] == 1 and f["exit"] == "lost with node 1"
        # the survivors' connections to host 1 broke and its launcher's line refused node 0's call: no silence waited
        assert f["detected_by"] == "connection error" and f["node_refused"] is True
        assert f["node_silent_s"] < nodes.NODE_SUSPECT_S
        assert f["rebuilt_from"] == "parity tier 2" and f["steps_lost"] <= 1 and f["survivors"] == [0, 1]
        assert {(r["rank"], r["node"], r["moved_from_node"], r["replacement"]) for r in f["replacements"]} == {
            (2, 0, 1, "shadow"), (3, 0, 1, "shadow")}
        assert f["fault_time"] == by_rank[2]["fault_time"]  # both died when the host went down
    pids = json.loads((run_dir / "ranks.json").read_text())["ranks"]
    assert sorted(pids) == ["0", "1", "2", "3"]  # host 0 ran all four ranks after the loss
    assert losses(run_dir) == reference_losses("world.nproc=4", *sharded)


@pytest.mark.timeout(240)
def test_a_host_lost_is_restarted_from_checkpoint_on_the_other_host_or_named_in_one_line(tmp_path, reference_losses):
    # the checkpoint baseline across hosts: node 0 restarts every rank of every host from the latest checkpoint;
    # first for a rank of host 1 (host 1 restarts its ranks too), then for host 1 itself (its ranks run on host 0)
    run_dir = tmp_path / "ckpt"
    p, left = run_dtk_on_bed("train", RECIPES / "quickstart.yaml", *TINY, "training.steps=10", f"output.dir={run_dir}",
                             "resilience.mode=checkpoint", "checkpoint.every=2", "--testbed", "2",
                             "--fault", "kill:rank=3,step=3", "--fault", "kill-host:host=1,step=7", "--no-progress",
                             timeout=200)
    assert p.returncode == 0, p.stderr[-3000:]
    assert left == []
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [(f["rank"], f["fault"], f.get("node_lost"), f["recovery"], f["restart_attempt"], f["checkpoint_step"])
            for f in summary["failures"]] == [(3, "kill", None, "checkpoint restart", 1, 2),
                                              (2, "kill-host", 1, "checkpoint restart", 2, 6),
                                              (3, "host lost", 1, "checkpoint restart", 2, 6)]
    assert [(e["node"], e["attempt"], e["ranks"]) for e in read_jsonl(run_dir / "events.jsonl")
            if e["event"] == "restart followed"] == [(1, 1, [2, 3])]
    assert sorted(json.loads((run_dir / "ranks.json").read_text())["ranks"]) == ["0", "1", "2", "3"]
    assert losses(run_dir) == reference_losses("world.nproc=4", "training.steps=10")

    # resilience.mode=none: nothing carries on without the host; one line names it, the lost ranks are recorded
    run_dir = tmp_path / "none"
    p, left = run_dtk_on_bed("train", RECIPES / "quickstart.yaml", *TINY, "training.steps=10", f"output.dir={run_dir}",
                             "--testbed", "2", "--fault", "kill-host:host=1,step=5", "--no-progress", timeout=120)
    assert p.returncode == 1 and left == [] and "Traceback" not in p.stderr
    [line] = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert "node 1 (ranks 2-3) went silent" in line and "resilience.mode=inplace or checkpoint" in line
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert [(f["rank"], f["node_lost"], f["detected_by"]) for f in summary["failures"]] == [
        (2, 1, "connection error"), (3, 1, "connection error")]


@pytest.mark.timeout(240)
def test_a_host_cut_off_for_a_while_is_fenced_and_its_rank_recovered_on_another_host(tmp_path, reference_losses):
    # 3 hosts x 1 rank (an odd world). Host 1's launcher freezes (SIGSTOP) for 3.6s while its rank goes on training:
    # node 0 stops hearing it, takes the host for lost and gives rank 1 to a shadow on a surviving host. The old
    # rank process reads that it was fenced and exits before any plan; the launcher, thawed, stops without
    # stopping the run. The survivors see the failure at any point of a step, here while the old rank still trains.
    run_dir = tmp_path / "cut"
    driver = start_dtk("train", RECIPES / "quickstart.yaml", *TINY, "training.steps=300", f"output.dir={run_dir}",
                       "world.nproc=1", "resilience.mode=inplace", "--testbed", "3", "--no-progress")
    deadline = time.monotonic() + 120
    while not ((run_dir / "ranks-node1.json").exists() and (run_dir / "metrics.jsonl").exists()
               and len(losses(run_dir)) >= 3):
        assert driver.poll() is None and time.monotonic() < deadline, driver.stderr.read()[-3000:]
        time.sleep(0.1)
    node1 = json.loads((run_dir / "ranks-node1.json").read_text())
    os.kill(node1["launcher"], signal.SIGSTOP)
    time.sleep(3.6)  # node 0 takes it for lost after 3s of silence
    os.kill(node1["launcher"], signal.SIGCONT)
    out, err = driver.communicate(timeout=180)
    assert driver.returncode == 0, err[-3000:]
    assert bed_left_behind(driver.pid) == []
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [(f["rank"], f["node_lost"], f["fault"]) for f in summary["failures"]] == [(1, 1, "host lost")]
    assert all(r["node"] in (0, 2) for f in summary["failures"] for r in f["replacements"])
    assert "took it for lost" in (run_dir / "logs" / "launcher1.log").read_text()
    old = [p for p in node1["ranks"].values()]
    assert not [p for p in old if Path(f"/proc/{p}").exists()]
    # no step was trained by two processes of one rank
    assert losses(run_dir) == reference_losses("world.nproc=3", "training.steps=300")
