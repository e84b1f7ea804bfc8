"""Multi-node resume: every host must read the checkpoint node 0 resumes from. Two launchers' checks (node 0 and
node 1, as threads) meet on a real TCPStore; each node's folder holds a real DCP checkpoint or not."""
from __future__ import annotations

import datetime
import shutil
import socket
import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dtk.errors import DtkError
from dtk.resilience.checkpoint import check_shared, checkpoint_dir, latest, resume_line, write_manifest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def save(run_dir, step: int) -> None:
    path = checkpoint_dir(run_dir) / f"step_{step}"
    dcp.save({"w": torch.arange(1000.0), "step": torch.tensor(step)}, checkpoint_id=str(path), no_dist=True)
    write_manifest(path)  # as rank 0 does once every rank's save returned


def both_nodes(dir0, dir1, *, resume: str = "auto") -> dict[int, str | None]:
    """Run node 0's and node 1's check at once; returns each node's error line (None: it passed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = datetime.timedelta(seconds=20)
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=t)
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=t)
    errors: dict[int, str | None] = {}

    def node(k, store, run_dir):
        try:
            check_shared(store, run_dir=run_dir, node_rank=k, nnodes=2, resume=resume, timeout_s=20)
            errors[k] = None
        except DtkError as e:
            errors[k] = "\n".join(e.lines)

    threads = [threading.Thread(target=node, args=(0, master, dir0)), threading.Thread(target=node, args=(1, client, dir1))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    return errors


@pytest.mark.timeout(60)
def test_a_host_without_node_0s_checkpoint_stops_both_nodes_in_one_line(tmp_path):
    save(tmp_path / "node0", 4)
    (tmp_path / "node1").mkdir()
    errors = both_nodes(tmp_path / "node0", tmp_path / "node1")
    host = socket.gethostname()
    assert errors[1] == (f"output.dir: got '{tmp_path / 'node1'}'; node 0 ({host}) resumes from step 4, but on this "
                         f"host (node 1, {host}) {tmp_path / 'node1' / 'checkpoints' / 'step_4'} lacks .metadata, "
                         f"__0_0.distcp (absent or cut short); put output.dir on a file system every host can read "
                         f"(NFS, Lustre, ...)")
    assert errors[0].startswith(f"output.dir: got '{tmp_path / 'node0'}'; node 0 resumes from the checkpoint of "
                                f"step 4, but node 1 ({host}): ")
    assert len(errors[0].splitlines()) == 1


@pytest.mark.timeout(60)
def test_a_half_copied_checkpoint_is_incomplete(tmp_path):
    save(tmp_path / "node0", 4)
    shutil.copytree(tmp_path / "node0", tmp_path / "node1")
    (checkpoint_dir(tmp_path / "node1") / "step_4" / "__0_0.distcp").write_bytes(b"cut short")
    assert latest(tmp_path / "node1") is None  # its manifest names the shard's size: not whole
    errors = both_nodes(tmp_path / "node0", tmp_path / "node1")
    assert "step_4 lacks __0_0.distcp (absent or cut short: 9 of " in errors[1] and errors[0] is not None


@pytest.mark.timeout(60)
def test_a_shared_folder_passes_and_a_stale_one_on_another_host_is_caught(tmp_path):
    save(tmp_path / "shared", 6)
    assert both_nodes(tmp_path / "shared", tmp_path / "shared") == {0: None, 1: None}
    (tmp_path / "fresh").mkdir()
    save(tmp_path / "stale", 2)  # node 1's local disk still holds an older run's checkpoint
    errors = both_nodes(tmp_path / "fresh", tmp_path / "stale")
    assert errors[0] is None  # node 0 starts afresh; node 1 refuses for both
    assert "node 0 starts afresh, but on this host (node 1" in errors[1]
    assert "it holds a checkpoint of step 2 that node 0 does not see" in errors[1]
    assert both_nodes(tmp_path / "fresh", tmp_path / "stale", resume="never") == {0: None, 1: None}


def test_a_damaged_checkpoint_is_skipped_for_the_newest_whole_one(tmp_path):
    save(tmp_path, 3)
    save(tmp_path, 6)
    assert latest(tmp_path)[0] == 6 and resume_line(tmp_path) == ""
    shard = checkpoint_dir(tmp_path) / "step_6" / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    assert latest(tmp_path)[0] == 3
    line = resume_line(tmp_path)
    assert line.startswith(f"resuming from the checkpoint of step 3 ({checkpoint_dir(tmp_path) / 'step_3'}): ")
    assert f"step_6: {shard.parent} lacks __0_0.distcp (absent or cut short: {size // 2} of {size} bytes)" in line
    (checkpoint_dir(tmp_path) / "step_3" / "manifest.json").unlink()  # as when its save never finished
    with pytest.raises(DtkError) as e:
        resume_line(tmp_path)
    assert len(e.value.lines) == 1 and "no checkpoint in it is whole" in e.value.lines[0]
    assert "step_3: it has no manifest.json (its save did not finish)" in e.value.lines[0]
