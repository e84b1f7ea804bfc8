"""After SIGTERM every rank stops at one agreed step, even a rank whose watcher thread has not seen the preempt flag
yet (it polls every 0.25 s; under load it saw it steps late, ran on past the step its peer stopped at, and both
waited for ever). Two ranks' Controls on a real TCPStore; their watcher threads are not started, so the flag is seen
by one rank only, as with a late watcher."""
from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

from dtk.resilience.control import Control


def test_a_rank_whose_watcher_is_late_stops_at_the_step_its_peer_proposed():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=20))
    early, late = (Control(address=f"127.0.0.1:{port}", rank=r, attempt=0) for r in (0, 1))
    assert early.stop_at(4) is None and late.stop_at(5) is None  # not preempted: run on
    early.preempted = True  # its watcher saw the flag at boundary 5; its peer's has not
    assert late.stop_at(6) is None  # the peer, one step ahead, asked before the proposal
    assert early.stop_at(5) == 7
    assert late.stop_at(7) == 7  # read from the store at its next boundary: both stop after 7 steps
    late.preempted = True  # its watcher catches up: the agreed step holds
    assert late.stop_at(7) == 7 and early.stop_at(7) == 7
    del master
