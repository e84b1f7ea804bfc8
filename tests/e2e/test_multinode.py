"""Two nodes on loopback through the real CLI: the ranks bind to the interface that routes to the endpoint (lo), and a
resume where each host kept its checkpoint on its own disk stops on both nodes in one line, exit 2."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.conftest import RECIPES, ROOT, TINY, dtk_env, run_dtk

pytestmark = pytest.mark.e2e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(dirs, *overrides: str) -> list[subprocess.CompletedProcess]:
    """`dtk train` as node 0 and node 1 of 2 (one rank each) meeting at a loopback endpoint; node k writes dirs[k]."""
    endpoint = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-m", "dtk.cli", "train", str(RECIPES / "quickstart.yaml"), *TINY,
                               "world.nproc=1", f"output.dir={dirs[k]}", *overrides, "--nnodes", "2",
                               "--node-rank", str(k), "--rdzv-endpoint", endpoint, "--no-progress"],
                              env=dtk_env(), cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for k in (0, 1)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=150)
        outs.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return outs


@pytest.mark.timeout(200)
def test_each_host_on_its_own_disk_cannot_resume_and_says_so_on_both_nodes(tmp_path):
    dirs = [tmp_path / "host0-disk", tmp_path / "host1-disk"]
    first = two_nodes(dirs, "training.steps=4", "checkpoint.every=2")
    assert first[0].returncode == 0, first[0].stderr[-3000:]
    for p in first:  # multi-node and nothing named: the interface that routes to the endpoint, said once
        assert p.stdout.count("network: ranks bind to lo (127.0.0.1") == 1
    # DCP wrote each rank's shard where that rank runs: node 0 has .metadata and rank 0's file, node 1 rank 1's
    assert (dirs[0] / "checkpoints" / "step_4" / ".metadata").is_file()
    assert not (dirs[1] / "checkpoints" / "step_4" / ".metadata").exists()

    again = two_nodes(dirs, "training.steps=6", "checkpoint.every=2")
    assert [p.returncode for p in again] == [2, 2]
    lines = [p.stderr.strip().splitlines() for p in again]
    assert all(len(x) == 1 for x in lines), lines
    host = socket.gethostname()
    step4 = [d / "checkpoints" / "step_4" for d in dirs]
    assert lines[1][0] == (f"error: output.dir: got '{dirs[1]}'; node 0 ({host}) resumes from step 4, but on this host "
                           f"(node 1, {host}) {step4[1]} lacks .metadata, __0_0.distcp (absent or cut short); put "
                           f"output.dir on a file system every host can read (NFS, Lustre, ...)")
    assert lines[0][0].startswith(f"error: output.dir: got '{dirs[0]}'; node 0 resumes from the checkpoint of step 4, "
                                  f"but this host (node 0): {step4[0]} lacks __1_0.distcp (absent or cut short); "
                                  f"node 1 ({host}): ")
    assert not (dirs[0] / "logs" / "rank0.log").read_text().count("resumed")  # no rank started on a mismatch


@pytest.mark.timeout(60)
def test_a_bad_interface_name_is_one_line_naming_what_exists():
    p = run_dtk("train", RECIPES / "quickstart.yaml", "world.interface=fast9", "--no-progress", timeout=50)
    names = ", ".join(sorted(n for _, n in socket.if_nameindex()))
    assert p.returncode == 2
    assert p.stderr.strip() == f"error: world.interface: got 'fast9'; interfaces on this host: {names}"


@pytest.mark.timeout(60)
def test_dtk_train_under_srun_reads_the_slurm_variables():
    # srun --ntasks-per-node=2 would start two launchers on one node: refused before anything starts
    env = {**dtk_env(), "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "1",
           "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "node[01]"}
    p = subprocess.run([sys.executable, "-m", "dtk.cli", "train", str(RECIPES / "quickstart.yaml"), "--no-progress"],
                       env=env, cwd=ROOT, text=True, capture_output=True, timeout=50)
    assert p.returncode == 2
    assert p.stderr.strip() == ("error: SLURM_STEP_NUM_TASKS: got 2 tasks on 1 nodes; accepted: one `dtk train` per "
                                "node (srun --ntasks-per-node=1); dtk starts world.nproc ranks on each node itself")
