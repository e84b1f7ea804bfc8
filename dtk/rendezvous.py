"""Where a run's nodes meet: the shape of the run (`Topology`, torchrun's spelling) and the run's TCPStore, which
node 0's launcher hosts (so it outlives any rank) and every other process connects to."""
from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(kw_only=True, slots=True)
class Topology:
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    """host:port of the store hosted by node 0's launcher; default: loopback and a free port."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def open_store(topology: Topology) -> tuple[dist.TCPStore, str]:
    """Node 0 hosts the run's store (on rdzv_endpoint, else loopback and a free port); the others connect to it."""
    if topology.rdzv_endpoint:
        host, _, port = topology.rdzv_endpoint.rpartition(":")
    else:
        host, port = "127.0.0.1", str(free_port())
    store = dist.TCPStore(host, int(port), is_master=topology.node_rank == 0, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=600))
    return store, f"{host}:{port}"
