"""Nodes of one run: every launcher but node 0's beats in the run's store, so that node 0 notices a node that went
silent (the host lost, its launcher with it); and in-place recovery across nodes: node 0's launcher coordinates
every recovery of the run; a launcher on another node reports its ranks' deaths to node 0 and carries out node 0's
replacement requests. Everything goes through the run's store (node 0's), under `dtk/run/nodes/<node>/`.

Node 0 hands the recovery sequence (dtk.resilience.recovery) a `Coordinator`: the RunView of the whole run. A rank
of a lost node is replaced on a surviving node (the one that hosts the fewest ranks), which then hosts it.
"""
from __future__ import annotations

import json
import select
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from dtk.resilience import protocol as keys
from dtk.resilience.recovery import RecoveryFailed, RunState, RunView

REPLACE_TIMEOUT_S = 120.0
"""How long node 0 waits for another node to start a rank's replacement (a cold start takes seconds)."""


NODE_BEAT_S = 0.1
"""How often a launcher on node k > 0 beats."""
NODE_SILENT_S = 3.0
"""A node whose launcher has not beaten for this long is lost (the host is gone, or cut off). A launcher polls every
20 ms: 30 beats missed in a row do not happen to a live one, even on a loaded machine."""
NODE_SUSPECT_S = 1.0
"""...or for this long while a rank is recovering with no rank known dead (its collectives broke: a peer is gone)."""
NODE_BROKEN_S = 0.3
"""...or for this long (3 beats) once a survivor's connection to the node's address broke: its processes died. A
live node whose rank died keeps beating, and reports the death within its 20 ms poll. On a loaded machine the
silence asked for grows with the node's own record: BROKEN_GAPS x the longest gap between two of its beats."""
BROKEN_GAPS = 1.5
RING_TIMEOUT_S = 0.1
"""How long node 0 waits for a node's line to answer or refuse (a refusal comes back in one round trip)."""


@dataclass(frozen=True, slots=True)
class NodeLoss:
    """Why node 0 took a node for lost."""

    silent_s: float
    """How long its launcher had been silent."""
    detected_by: str
    """"connection error" (a survivor's connection to it, or node 0's held line, broke; then its line refused a call
    or it fell silent) or "node heartbeat" (silence)."""
    address: str | None = None
    """The node's address the broken connection named."""
    refused: bool = False
    """Its launcher's line refused node 0's call (NodeLine): its process is gone, no silence was waited for."""


class NodeLine:
    """A launcher on node k > 0 listens on a port of its own, published when it joins. Node 0 holds a connection to
    it (HeldLines), which the kernel closes when the launcher's process ends: node 0 hears a launcher's death at
    once, with no silence to wait for and no rank's collective needed. It is confirmed by a call: refused, the
    launcher's process is gone while its host still answers (the node is lost); answered, it lives (a dropped
    connection alone proves nothing); no answer (the host down, or cut off) leaves it to the silence. The launcher
    answers at its poll (`answer`): a live one never refuses, and a frozen one's kernel still takes the call."""

    def __init__(self):
        if socket.has_dualstack_ipv6():
            self.sock = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=16)
        else:
            self.sock = socket.create_server(("", 0), backlog=16)
        self.sock.setblocking(False)
        self.port: int = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        """the calls taken and kept open (node 0's held line); closed by node 0 when it is done with them"""

    def answer(self) -> None:
        """Take the calls waiting and keep them open; let go of those the caller hung up."""
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            self.held.append(conn)
        if self.held:
            for conn in select.select(self.held, [], [], 0)[0]:
                if not _still_open(conn):
                    conn.close()
                    self.held.remove(conn)

    def close(self) -> None:
        for conn in self.held:
            conn.close()
        self.held.clear()
        self.sock.close()


def _still_open(conn: socket.socket) -> bool:
    """A readable connection of a line: False when its other end closed it (or it broke)."""
    try:
        return bool(conn.recv(64))
    except OSError:
        return False


def call(address: str, port: int, *, timeout_s: float = RING_TIMEOUT_S, keep: bool = False):
    """Call a node's line at `address`: True it answered (with `keep`, the open connection instead), False it refused
    (nothing listens there), None no word."""
    try:
        conn = socket.create_connection((address, port), timeout=timeout_s)
    except ConnectionRefusedError:
        return False
    except OSError:  # timed out, unreachable: the host itself may be gone, or cut off
        return None
    if not keep:
        conn.close()
        return True
    conn.setblocking(False)
    return conn


class HeldLines:
    """Node 0's connections to the other nodes' lines (NodeLine), opened once each has joined: a connection its
    other end closed, followed by a refused call, is a launcher that is gone. Only the line of a node that node 0
    once reached is called: a refusal from a port never reached (a firewall's reset, say) proves nothing."""

    RETRY_S = 1.0
    """How long node 0 waits before it tries again to open a node's line it could not reach; doubled each time, so
    that an unreachable line (each try waits up to RING_TIMEOUT_S per address) does not hold up node 0's watch."""

    def __init__(self):
        self.lines: dict[int, tuple[list[str], int]] = {}
        """node -> (its addresses, its line's port), from its joined record"""
        self.held: dict[int, tuple[socket.socket, str]] = {}
        """node -> (the connection node 0 holds, the address it reached)"""
        self.next_try: dict[int, tuple[float, float]] = {}
        """node -> (when to try opening its line again, the wait after that)"""
        self.reached: set[int] = set()
        """the nodes whose line node 0 held at least once"""
        self.read: set[int] = set()
        """the nodes whose joined record was read"""

    def know(self, node: int, joined) -> None:
        """Read the node's line from its joined record (once)."""
        self.read.add(node)
        if isinstance(joined, dict) and isinstance(joined.get("line"), int):
            self.lines[node] = (list(joined.get("addresses", [])), joined["line"])

    def hold(self, node: int, now: float) -> None:
        """Open the node's line when not held (again after RETRY_S, then twice as long each time)."""
        due, wait = self.next_try.get(node, (now, self.RETRY_S))
        if node in self.held or node not in self.lines or now < due:
            return
        addresses, port = self.lines[node]
        for address in addresses:
            if isinstance(conn := call(address, port, keep=True), socket.socket):
                self.held[node] = (conn, address)
                self.reached.add(node)
                self.next_try.pop(node, None)
                return
        self.next_try[node] = (now + wait, 2 * wait)

    def dropped(self) -> dict[int, str]:
        """The nodes whose held line was closed from its end since the last look: node -> the address it had."""
        if not self.held:
            return {}
        out = {}
        readable = select.select([conn for conn, _ in self.held.values()], [], [], 0)[0]
        for node, (conn, address) in list(self.held.items()):
            if conn in readable and not _still_open(conn):
                conn.close()
                del self.held[node]
                out[node] = address
        return out

    def ring(self, node: int, address: str) -> bool | None:
        """Call the node's line: True it answered, False it refused (its launcher is gone), None no word (or a line
        never reached)."""
        return call(address, self.lines[node][1]) if node in self.reached else None

    def let_go(self, node: int) -> None:
        if held := self.held.pop(node, None):
            held[0].close()

    def close(self) -> None:
        for node in list(self.held):
            self.let_go(node)


class NodeBeat:
    """A launcher on node k > 0: beats (a counter in the store) and finds out whether node 0 took it for lost."""

    def __init__(self, *, run_store, node: int):
        self.store, self.node = run_store, node
        self.line = NodeLine()
        self._next = 0.0

    def beat(self) -> str | None:
        """Beat when due (and answer node 0's calls); returns what node 0 said when it declared this node lost (then
        the node must stop)."""
        self.line.answer()
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + NODE_BEAT_S
        self.store.add(keys.node_beat(self.node), 1)
        if self.store.check([keys.node_lost(self.node)]):
            return self.store.get(keys.node_lost(self.node)).decode()
        return None


class NodeWatch:
    """Node 0: the nodes whose launcher stopped beating (those that left at the end excepted): for NODE_SILENT_S,
    or for less when the ranks' collectives say a peer is gone (NODE_SUSPECT_S) or name the node's address in a
    broken connection (NODE_BROKEN_S, or more for a node seen to beat irregularly). Node 0's held line to a node
    closing counts as a broken connection; a node with a broken connection whose line then refuses node 0's call
    (NodeLine) is lost at once."""

    def __init__(self, *, run_store, nnodes: int):
        self.store, self.nnodes = run_store, nnodes
        self.seen: dict[int, tuple[int, float]] = {}
        self.longest_gap: dict[int, float] = {}
        """node -> the longest time between two of its beats seen so far (its launcher alive)"""
        self.lost: dict[int, NodeLoss] = {}
        self._addresses: dict[str, int] | None = None
        self.lines = HeldLines()
        self._called: dict[int, float] = {}
        """node -> when node 0 last called its line (once per NODE_BEAT_S while a connection to it is broken)"""
        self._dropped: dict[int, str] = {}
        """node -> the address of node 0's held line to it, closed from its end (it counts as a broken connection)"""
        self._unknown: set[str] = set()
        self._next = 0.0

    def silent(self, *, suspect=lambda: False, active=lambda node: True, named=lambda: []) -> list[int]:
        """Nodes newly found lost (each once); they are marked lost in the store: a node that was only slow
        reads that and stops its ranks (never two processes for one rank). `suspect()`: a peer is known to be gone
        (a rank's collectives broke and no death explains it), so a shorter silence is enough; asked only of a node
        silent that long. `named()`: the addresses the ranks' broken connections named in this generation.
        `active(node)`: whether the node still has ranks to run (one whose ranks are all done may be writing its
        summary)."""
        now = time.monotonic()
        self._dropped.update(self.lines.dropped())
        if now < self._next and not self._dropped:
            return []
        broken = {node: a for a in named() if (node := self._node_at(a)) is not None}
        line_first = {node: a for node, a in self._dropped.items() if node not in broken}
        broken.update(line_first)
        self._next = now + (0.0 if broken else NODE_BEAT_S)  # a node named: decide at the launcher's own poll
        out = []
        for node in range(1, self.nnodes):
            if node in self.lost or not self.store.check([keys.joined(node)]) or self.store.check([keys.left(node)]):
                continue
            if node not in self.lines.read:
                self.lines.know(node, keys.read_json(self.store, keys.joined(node)))
            self.lines.hold(node, now)
            beats = self.store.add(keys.node_beat(node), 0)
            count, since = self.seen.get(node, (-1, now))
            if beats != count:
                if count >= 0:
                    self.longest_gap[node] = max(self.longest_gap.get(node, 0.0), now - since)
                self.seen[node] = (beats, now)
                if node not in broken:
                    continue
            quiet = now - since
            if node in broken and active(node) and self._refuses(node, broken[node], now):
                by = "node 0's line to this node" if node in line_first else "a rank's connection to this node"
                loss = NodeLoss(silent_s=quiet, detected_by="connection error", address=broken[node], refused=True)
                said = (f"{by} ({broken[node]}) broke and this node's launcher did not answer node 0's call (port "
                        f"{self.lines.lines[node][1]} refused it): node 0 took the node for lost")
            elif node in broken and quiet > self.broken_wait(node) and active(node):
                loss = NodeLoss(silent_s=quiet, detected_by="connection error", address=broken[node])
                said = (f"a rank's connection to this node ({broken[node]}) broke and node 0 heard nothing from "
                        f"this node's launcher for {quiet:.1f}s: it took the node for lost")
            elif (quiet > NODE_SILENT_S or (quiet > NODE_SUSPECT_S and suspect())) and active(node):
                loss = NodeLoss(silent_s=quiet, detected_by="node heartbeat")
                said = f"node 0 heard nothing from this node's launcher for {quiet:.1f}s and took it for lost"
            else:
                continue
            self.lost[node] = loss
            self.lines.let_go(node)
            self.store.set(keys.node_lost(node), said)
            out.append(node)
        return out

    def _refuses(self, node: int, address: str, now: float) -> bool:
        """Call the line of `node` (at `address`, where a connection to it broke) when due: whether it refused (its
        launcher is gone)."""
        if now - self._called.get(node, -NODE_BEAT_S) < NODE_BEAT_S:
            return False
        self._called[node] = now
        answer = self.lines.ring(node, address)
        if answer is True:
            self._dropped.pop(node, None)  # its held line closed, yet it lives: hold it again
        return answer is False

    def broken_wait(self, node: int) -> float:
        """The silence after which a node named by a broken connection is lost."""
        return min(NODE_SUSPECT_S, max(NODE_BROKEN_S, BROKEN_GAPS * self.longest_gap.get(node, 0.0)))

    def _node_at(self, address: str) -> int | None:
        """The node (k > 0) whose host has `address`; None when no node, or more than one (nodes of one host)."""
        if self._addresses is None or (address not in self._addresses and address not in self._unknown):
            self._unknown.add(address)
            owners: dict[str, set[int]] = {}
            for node in range(1, self.nnodes):
                joined = keys.read_json(self.store, keys.joined(node)) if self.store.check([keys.joined(node)]) \
                    else None
                if not isinstance(joined, dict):
                    continue
                for a in joined.get("addresses", []):
                    owners.setdefault(a, set()).add(node)
            self._addresses = {a: min(k) for a, k in owners.items() if len(k) == 1}
        return self._addresses.get(address)


class NodeReporter:
    """A launcher on node k > 0: publishes which of its ranks are dead in its attempt (a snapshot, so node 0 never
    sees a death twice once the rank is replaced), answers node 0's replacement requests in order (in place), and
    finds out when node 0 restarted the run from a checkpoint (a new attempt, with the ranks this node runs in it)."""

    def __init__(self, *, run_store, node: int):
        self.store, self.node = run_store, node
        self.attempt = 0
        self.next_request = 0
        self._published: str | None = None

    def publish(self, dead: dict[int, dict]) -> None:
        """`dead`: rank -> {"code": exit status, "detected_at": time}; only changes go to the store."""
        text = json.dumps({"attempt": self.attempt, "ranks": {str(r): v for r, v in sorted(dead.items())}})
        if text != self._published:
            self.store.set(keys.node_dead(self.node), text)
            self._published = text

    def restart_due(self) -> tuple[int, list[int]] | None:
        """(attempt, the ranks this node runs in it) when node 0 started a newer attempt than this node's."""
        if not self.store.check([keys.RESTART]):
            return None
        restart = json.loads(self.store.get(keys.RESTART))
        if restart["attempt"] <= self.attempt:
            return None
        return restart["attempt"], [int(r) for r, node in restart["placement"].items() if node == self.node]

    def serve(self, replace, dead: dict[int, dict]) -> None:
        """Carry out node 0's requests: `replace(rank, generation) -> dict` (the launcher's own); the new snapshot
        of dead ranks is published before the answer, so node 0 never reads a replaced rank as dead."""
        while self.store.check([keys.replace_request(self.node, self.next_request)]):
            seq = self.next_request
            request = json.loads(self.store.get(keys.replace_request(self.node, seq)))
            how = replace(request["rank"], request["generation"])
            dead.pop(request["rank"], None)
            self.publish(dead)
            self.store.set(keys.replaced(self.node, seq), json.dumps(how))
            self.next_request += 1


class Coordinator:
    """Node 0's view of the whole run for the recovery sequence (dtk.resilience.recovery.RunView): every rank of
    every node; a rank of node k is replaced by node k's launcher on request (in place), and a checkpoint restart
    restarts every node's ranks (`announce_restart`)."""

    def __init__(self, *, local: RunView, state: RunState, run_store, nnodes: int, nproc: int, watch: NodeWatch):
        self.local, self.state = local, state
        """node 0's own processes, and where the run stands (its attempt, control and generation)"""
        self.store, self.nnodes, self.nproc, self.watch = run_store, nnodes, nproc, watch
        self._requests = [0] * nnodes
        self.placement = {r: r // nproc for r in range(nnodes * nproc)}
        """rank -> the node that hosts it: its own, until its node is lost and a surviving node takes it"""

    # the RunView's fields: the run's, as node 0 sees them
    @property
    def control(self) -> dist.Store:
        return self.local.control

    @property
    def run_dir(self) -> Path:
        return self.local.run_dir

    @property
    def generation(self) -> int:
        return self.state.generation

    def node_of(self, rank: int) -> int:
        return self.placement[rank]

    def on_lost_nodes(self) -> list[int]:
        """The ranks hosted by a lost node (not replaced yet): they died with it."""
        return sorted(r for r, node in self.placement.items() if node in self.watch.lost)

    def hosted(self, node: int) -> list[int]:
        return sorted(r for r, k in self.placement.items() if k == node)

    def announce_restart(self, attempt: int) -> list[int]:
        """A checkpoint restart: every node stops its ranks and starts those it runs in `attempt`; a lost node's
        ranks are run by the surviving ones. Returns the ranks node 0 runs."""
        for r in self.on_lost_nodes():
            self.placement[r] = self._host_for(r)
        self.store.set(keys.RESTART, json.dumps({"attempt": attempt, "placement": self.placement}))
        return self.hosted(0)

    def fence_lost(self) -> None:
        """Mark every process of a rank on a lost node (by the token in its last beat) before it is replaced: if
        the node was only cut off for a while, such a rank exits at its next beat, and before any plan it reads."""
        control = self.control
        for r in self.on_lost_nodes():
            if control.check([keys.beat(r)]):
                token = json.loads(control.get(keys.beat(r)))["token"]
                node = self.placement[r]
                control.set(keys.fenced(token), f"node 0 took node {node} for lost after "
                                               f"{self.watch.lost[node].silent_s:.1f}s without a word from it, and "
                                               f"gave rank {r} to another process")

    def remote_dead(self) -> dict[int, dict]:
        """The ranks other (live) nodes report dead, and have not replaced yet: rank -> {code, detected_at}."""
        out: dict[int, dict] = {}
        for node in range(1, self.nnodes):
            if node not in self.watch.lost and self.store.check([keys.node_dead(node)]):
                reported = json.loads(self.store.get(keys.node_dead(node)))
                if reported["attempt"] == self.state.attempt:  # not the deaths of an attempt restarted since
                    out.update({int(r): v for r, v in reported["ranks"].items() if self.placement[int(r)] == node})
        return out

    def ranks(self) -> list[int]:
        return list(range(self.nnodes * self.nproc))

    def dead(self) -> list[int]:
        return sorted(set(self.local.dead()) | set(self.remote_dead()) | set(self.on_lost_nodes()))

    def _host_for(self, rank: int) -> int:
        node = self.placement[rank]
        if node not in self.watch.lost:
            return node
        alive = [k for k in range(self.nnodes) if k not in self.watch.lost]
        return min(alive, key=lambda k: (sum(1 for v in self.placement.values() if v == k), k))

    def replace(self, rank: int, generation: int) -> dict:
        node = self._host_for(rank)
        moved = {"moved_from_node": self.placement[rank]} if node != self.placement[rank] else {}
        self.placement[rank] = node
        if node == 0:
            return {**self.local.replace(rank, generation), "node": 0, **moved}
        seq = self._requests[node]
        self._requests[node] += 1
        self.store.set(keys.replace_request(node, seq), json.dumps({"rank": rank, "generation": generation}))
        answer = keys.replaced(node, seq)
        deadline = time.monotonic() + REPLACE_TIMEOUT_S
        while not self.store.check([answer]):
            if time.monotonic() > deadline:
                raise RecoveryFailed(f"node {node} did not replace rank {rank} in {REPLACE_TIMEOUT_S:.0f}s")
            time.sleep(0.005)
        return {**json.loads(self.store.get(answer)), "node": node, **moved}
