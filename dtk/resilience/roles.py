"""What one launcher's node is to the run: a single node; node 0 of several (the lead: it watches the others' beats,
names a node that never joined and, in place or checkpoint, coordinates every node's recoveries); or another node
(a follower: it beats, reports its ranks' deaths to node 0 and follows its restarts). A role reports what it sees;
the supervisor (dtk.resilience.supervisor) decides what the run does about it."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Protocol

import torch.distributed as dist

from dtk.resilience import protocol as keys
from dtk.resilience.failures import FailureRecord
from dtk.resilience.nodes import Coordinator, NodeBeat, NodeLoss, NodeReporter, NodeWatch
from dtk.resilience.recovery import RunState, RunView

LEAVE_WAIT_S = 15.0
"""How long node 0's launcher (it hosts the store) waits at the end for the other nodes' launchers to leave."""

Replace = Callable[[int, int], dict]
"""replace(rank, generation) -> how: a promoted shadow or a cold process takes the rank."""


def nodes_named(nodes: list[int], *, nproc: int) -> str:
    """node 1 (ranks 2-3), node 2 (ranks 4-5)"""
    n = nproc
    return ", ".join(f"node {k} (rank{'s' if n > 1 else ''} {k * n}{f'-{k * n + n - 1}' if n > 1 else ''})"
                     for k in nodes)


def absent_line(nodes: list[int], *, nproc: int, timeout_s: float, nnodes: int, address: str) -> str:
    """Node 0's line for nodes that never joined: which, where they should have come, and how to start them."""
    who = nodes_named(nodes, nproc=nproc)
    which = str(nodes[0]) if len(nodes) == 1 else "K"
    return (f"error: {who} never joined the rendezvous at {address} within world.timeout_s={timeout_s:g}s; start "
            f"`dtk train` there with --nnodes {nnodes} --node-rank {which} --rdzv-endpoint {address}, and check that "
            f"it can reach this host; the run is stopped.")


class Processes(Protocol):
    """The processes of this node, as recovery sees them (dtk.launch.Host)."""

    def ranks(self) -> list[int]: ...

    def dead(self) -> list[int]: ...

    def replace(self, rank: int, generation: int) -> dict: ...


class LocalView:
    """The RunView of one node's processes: a single node's run, or (node 0 of several) what the Coordinator asks of
    node 0's own ranks."""

    def __init__(self, *, processes: Processes, state: RunState, run_dir: Path):
        self.processes, self.state, self._run_dir = processes, state, run_dir

    @property
    def control(self) -> dist.Store:
        assert self.state.control is not None, "the run has not started"
        return self.state.control

    @property
    def generation(self) -> int:
        return self.state.generation

    @property
    def run_dir(self) -> Path:
        return self._run_dir

    def ranks(self) -> list[int]:
        return self.processes.ranks()

    def dead(self) -> list[int]:
        return self.processes.dead()

    def replace(self, rank: int, generation: int) -> dict:
        return self.processes.replace(rank, generation)


class SingleNode:
    """The whole run on one node: nothing to report to, nothing to hear from."""

    coordinates = False
    reports = False
    line_port: int | None = None
    """The port of this launcher's line (dtk.resilience.nodes.NodeLine): only a node k > 0 of several has one."""

    def __init__(self, *, view: RunView, nproc: int):
        self.view, self.nproc = view, nproc

    def stopped_elsewhere(self) -> dict | None:
        return None

    def never_joined(self, *, since: float, timeout_s: float) -> list[int]:
        return []

    def absent_now(self) -> list[int]:
        return []

    def fenced(self) -> str | None:
        return None

    def lost_nodes(self, *, suspect: Callable[[], bool], active: Callable[[int], bool],
                   named: Callable[[], list[str]]) -> list[int]:
        return []

    def ranks_of(self, node: int) -> list[int]:
        return list(range(node * self.nproc, node * self.nproc + self.nproc))

    def lost_node_of(self, rank: int) -> int | None:
        return None

    def loss(self, node: int) -> NodeLoss | None:
        return None

    def remote_death(self, rank: int) -> dict:
        return {}

    def remote_failed(self) -> list[int]:
        return []

    def tend(self, replace: Replace, dead: dict[int, dict]) -> tuple[int, list[int]] | None:
        return None

    def follow(self, attempt: int) -> None:
        pass

    def announce_restart(self, attempt: int) -> list[int] | None:
        return None

    def leave(self, code: int, *, fenced: bool, messages: list[str], failures: list[FailureRecord]) -> None:
        pass


class _Membership:
    """What every node of several shares: the run's store, who joined, who stopped the run, who left."""

    def __init__(self, *, run_store: dist.Store, node: int, nnodes: int):
        self.store, self.node, self.nnodes = run_store, node, nnodes

    def stopped_elsewhere(self) -> dict | None:
        """Another node's launcher stopped the run (its rank failed, Ctrl-C): what it said, else None."""
        return keys.read_json(self.store, keys.STOPPED)

    def missing(self) -> list[int]:
        """The nodes whose launcher has not reached the store yet."""
        return [k for k in range(1, self.nnodes) if not self.store.check([keys.joined(k)])]

    def say_stop_and_leave(self, code: int, *, fenced: bool, messages: list[str],
                           failures: list[FailureRecord]) -> None:
        """A failed node tells the others to stop (unless node 0 fenced it: node 0 carries on); every node says it
        has left."""
        if code != 0 and not fenced and not self.store.check([keys.STOPPED]):
            self.store.set(keys.STOPPED, json.dumps({"node": self.node, "code": code, "messages": messages,
                                                     "failures": [f.to_dict() for f in failures]}))
        self.store.set(keys.left(self.node), str(code))


class LeadNode:
    """Node 0 of several: it hosts the store, watches the other nodes' beats and, in place or checkpoint
    (`coordinator`), is the RunView of the whole run: every recovery is node 0's."""

    reports = False
    line_port: int | None = None

    def __init__(self, *, local: RunView, state: RunState, run_store: dist.Store, nnodes: int, nproc: int,
                 coordinate: bool):
        self.nnodes, self.nproc = nnodes, nproc
        self.members = _Membership(run_store=run_store, node=0, nnodes=nnodes)
        self.watch = NodeWatch(run_store=run_store, nnodes=nnodes)
        self.coordinator = Coordinator(local=local, state=state, run_store=run_store, nnodes=nnodes, nproc=nproc,
                                       watch=self.watch) if coordinate else None
        self.view: RunView = self.coordinator or local
        self.coordinates = self.coordinator is not None
        self.absent: list[int] | None = None
        """The nodes that never joined, once known ([] once every node joined)."""

    def stopped_elsewhere(self) -> dict | None:
        return self.members.stopped_elsewhere()

    def never_joined(self, *, since: float, timeout_s: float) -> list[int]:
        """The nodes whose launcher has not reached the store `timeout_s` after `since` (none before), once."""
        if self.absent is not None:
            return []
        missing = self.members.missing()
        if not missing:
            self.absent = []
            return []
        if time.time() - since > timeout_s:
            self.absent = missing
            return missing
        return []

    def absent_now(self) -> list[int]:
        """A failure before every rank started: the nodes missing now (the rendezvous timed out for them), once."""
        if self.absent is None and (missing := self.members.missing()):
            self.absent = missing
            return missing
        return []

    def fenced(self) -> str | None:
        return None

    def lost_nodes(self, *, suspect: Callable[[], bool], active: Callable[[int], bool],
                   named: Callable[[], list[str]]) -> list[int]:
        silent = self.watch.silent(suspect=suspect, active=active, named=named)
        if silent and self.coordinator is not None:
            self.coordinator.fence_lost()  # a node only cut off for a while must not keep its ranks
        return silent

    def remote_failed(self) -> list[int]:
        """The ranks of other nodes that are dead: reported by their node, or lost with it."""
        if self.coordinator is None:
            return []
        return [*self.coordinator.remote_dead(), *self.coordinator.on_lost_nodes()]

    def announce_restart(self, attempt: int) -> list[int] | None:
        """A checkpoint restart: every node restarts with node 0; the ranks node 0 runs in it (None: its own)."""
        return self.coordinator.announce_restart(attempt) if self.coordinator is not None else None

    def ranks_of(self, node: int) -> list[int]:
        """The ranks `node` runs now: its own, or (in place, checkpoint) what node 0's placement says."""
        if self.coordinator is not None:
            return self.coordinator.hosted(node)
        return list(range(node * self.nproc, node * self.nproc + self.nproc))

    def lost_node_of(self, rank: int) -> int | None:
        """The lost node that hosted `rank` (a rank of another node), if it was lost with its node."""
        node = self.coordinator.node_of(rank) if self.coordinator is not None else rank // self.nproc
        return node if node in self.watch.lost else None

    def loss(self, node: int) -> NodeLoss | None:
        """Why a lost node was declared lost, and how long it had been silent then."""
        return self.watch.lost.get(node)

    def remote_death(self, rank: int) -> dict:
        """What another node reported of its dead rank: {code, detected_at[, hang_detected_at]}."""
        return self.coordinator.remote_dead().get(rank, {}) if self.coordinator is not None else {}

    def tend(self, replace: Replace, dead: dict[int, dict]) -> tuple[int, list[int]] | None:
        return None

    def follow(self, attempt: int) -> None:
        pass

    def leave(self, code: int, *, fenced: bool, messages: list[str], failures: list[FailureRecord]) -> None:
        """Node 0 waits (a while) for the other nodes to leave, so that none loses the store while it still reports."""
        self.members.say_stop_and_leave(code, fenced=fenced, messages=messages, failures=failures)
        deadline = time.monotonic() + LEAVE_WAIT_S
        while time.monotonic() < deadline:
            gone = set(self.absent or []) | set(self.watch.lost)
            if all(self.members.store.check([keys.left(k)]) for k in range(1, self.nnodes) if k not in gone):
                break
            time.sleep(0.05)
        self.watch.lines.close()


class FollowerNode:
    """Node k > 0 of several: it beats; in place or checkpoint (`reporter`) node 0 recovers its ranks, so it reports
    their deaths, carries out node 0's replacement requests and follows node 0's checkpoint restarts."""

    coordinates = False

    def __init__(self, *, view: RunView, run_store: dist.Store, node: int, nnodes: int, nproc: int, report: bool):
        self.view, self.nproc = view, nproc
        self.members = _Membership(run_store=run_store, node=node, nnodes=nnodes)
        self.beat = NodeBeat(run_store=run_store, node=node)
        self.line_port: int | None = self.beat.line.port
        self.reporter = NodeReporter(run_store=run_store, node=node) if report else None
        self.reports = self.reporter is not None

    def stopped_elsewhere(self) -> dict | None:
        return self.members.stopped_elsewhere()

    def never_joined(self, *, since: float, timeout_s: float) -> list[int]:
        return []

    def absent_now(self) -> list[int]:
        return []

    def fenced(self) -> str | None:
        """Beat when due; what node 0 said if it took this node for lost (then this node's ranks must stop)."""
        return self.beat.beat()

    def lost_nodes(self, *, suspect: Callable[[], bool], active: Callable[[int], bool],
                   named: Callable[[], list[str]]) -> list[int]:
        return []

    def tend(self, replace: Replace, dead: dict[int, dict]) -> tuple[int, list[int]] | None:
        """Node 0's restart when it started a newer attempt: (attempt, the ranks this node runs in it); else report
        `dead` (rank -> {code, detected_at}) and carry out node 0's replacement requests with `replace`."""
        assert self.reporter is not None
        if restart := self.reporter.restart_due():
            return restart
        self.reporter.publish(dead)
        self.reporter.serve(replace, dead)
        return None

    def follow(self, attempt: int) -> None:
        """This node runs node 0's restart `attempt` now: it reports the deaths of that attempt."""
        assert self.reporter is not None
        self.reporter.attempt = attempt

    def ranks_of(self, node: int) -> list[int]:
        return list(range(node * self.nproc, node * self.nproc + self.nproc))

    def lost_node_of(self, rank: int) -> int | None:
        return None

    def loss(self, node: int) -> NodeLoss | None:
        return None

    def remote_death(self, rank: int) -> dict:
        return {}

    def remote_failed(self) -> list[int]:
        return []

    def announce_restart(self, attempt: int) -> list[int] | None:
        return None

    def leave(self, code: int, *, fenced: bool, messages: list[str], failures: list[FailureRecord]) -> None:
        self.members.say_stop_and_leave(code, fenced=fenced, messages=messages, failures=failures)
        self.beat.line.close()


def node_role(*, nnodes: int, node: int, mode: str, nproc: int, local: LocalView, state: RunState,
              run_store: dist.Store) -> SingleNode | LeadNode | FollowerNode:
    """One node: no role. Several: node 0 leads (and coordinates recovery in place or checkpoint), the others follow
    (and report to node 0 in place or checkpoint); with mode none the node whose rank failed stops the run."""
    if nnodes == 1:
        return SingleNode(view=local, nproc=nproc)
    recovers = mode in ("inplace", "checkpoint")
    if node == 0:
        return LeadNode(local=local, state=state, run_store=run_store, nnodes=nnodes, nproc=nproc, coordinate=recovers)
    return FollowerNode(view=local, run_store=run_store, node=node, nnodes=nnodes, nproc=nproc, report=recovers)
