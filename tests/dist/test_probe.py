"""`dtk probe` as a user runs it: 3 hosts on loopback meeting at a TCPStore (one `dtk probe` each), a host that never
joins named by number, and on the test bed (root) a pair shaped to 200 mbit among unshaped ones named the slowest."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtk.rendezvous import free_port
from dtk.testbed.net import namespaces, unavailable_reason
from tests.conftest import ROOT, dtk_env, run_dtk

pytestmark = pytest.mark.dist


@pytest.mark.timeout(120)
def test_three_hosts_on_loopback_give_a_full_matrix(tmp_path):
    endpoint, out = f"127.0.0.1:{free_port()}", tmp_path / "probe.json"
    procs = [subprocess.Popen([sys.executable, "-m", "dtk.cli", "probe", "--hosts", "3", "--rdzv-endpoint", endpoint,
                               "--node-rank", str(k), "--size", "1M", "--passes", "2", "--pings", "5",
                               *(["--json", str(out)] if k == 0 else [])],
                              env=dtk_env(), cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for k in range(3)]
    outs = [p.communicate(timeout=100) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [o[1][-2000:] for o in outs]
    assert "slowest link: " in outs[0][0] and f"written: {out}" in outs[0][0]
    assert outs[1][0].strip().endswith("node 1: probed; the table is on node 0")
    r = json.loads(out.read_text())
    assert r["mode"] == "hosts" and r["bytes"] == 1 << 20 and len(r["hosts"]) == 3
    assert [h["interface"] for h in r["hosts"]] == ["lo"] * 3  # the interface routing to the endpoint
    for i in range(3):
        for j in range(3):
            bw, rtt, least = r["bandwidth_bytes_per_s"][i][j], r["rtt_us"][i][j], r["rtt_min_us"][i][j]
            assert (bw is None and rtt is None) if i == j else (bw > 0 and rtt >= least > 0)
    assert [x["link"] for x in r["links"]] == ["0-1", "0-2", "1-2"]
    slowest = min(r["links"], key=lambda x: x["bytes_per_s"])
    assert r["slowest"]["link"] == slowest["link"]
    assert r["slowest"]["below_median"] == pytest.approx(r["median_bytes_per_s"] / slowest["bytes_per_s"])


@pytest.mark.timeout(60)
def test_a_host_that_never_joins_is_named():
    endpoint = f"127.0.0.1:{free_port()}"
    p = run_dtk("probe", "--hosts", "2", "--rdzv-endpoint", endpoint, "--timeout", "2", timeout=50)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == f"error: --hosts: got 2; host(s) 1 did not join at {endpoint} within " \
                                                "--timeout 2s"


@pytest.mark.timeout(120)
@pytest.mark.skipif(unavailable_reason() is not None, reason=f"test bed: {unavailable_reason()}")
def test_a_pair_shaped_to_200mbit_is_the_slowest_link_and_the_bed_is_gone(tmp_path):
    out = tmp_path / "probe.json"
    p = subprocess.Popen([sys.executable, "-m", "dtk.cli", "probe", "--testbed", "3", "--congest",
                          "pair=0-1,rate=200mbit", "--passes", "5", "--json", str(out)], env=dtk_env(), cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = p.communicate(timeout=110)
    assert p.returncode == 0, stderr[-3000:]
    assert [ns for ns in namespaces() if ns.startswith(f"dtkp{p.pid}")] == []
    r = json.loads(out.read_text())
    assert r["mode"] == "testbed" and r["congest"] == ["pair=0-1,rate=200mbit"]
    assert r["slowest"]["link"] == "0-1"
    assert "0-1" in r["congested_links"]  # as the comm planner would classify it
    assert f"slowest link: 0-1 at {r['slowest']['bytes_per_s'] / 1e6:,.1f} MB/s" in stdout
    assert r["slowest"]["bytes_per_s"] < 200e6 / 8 * 1.2  # the shaped rate (+ its 256 KB burst), not more


@pytest.mark.timeout(60)
@pytest.mark.skipif(unavailable_reason() is not None, reason=f"test bed: {unavailable_reason()}")
def test_on_a_test_bed_host_the_picker_binds_the_interface_that_reaches_the_endpoint():
    import os

    from dtk.testbed.net import Testbed

    with Testbed(n=2, tag=f"i{os.getpid() % 100000}") as bed:
        prefix, _ = bed.spawn_prefix(0)
        code = ("from dtk import netif; import sys; "
                "print(netif.pick(None, endpoint=sys.argv[1])[0], netif.pick(None, endpoint='127.0.0.1:1')[0])")
        env = {k: v for k, v in dtk_env().items() if k != "GLOO_SOCKET_IFNAME"}
        p = subprocess.run([*prefix, sys.executable, "-c", code, f"{bed.ip(1)}:29500"], env=env, cwd=ROOT,
                           text=True, capture_output=True, timeout=50)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["eth0", "lo"]  # host 1 through the host's link; loopback stays loopback
