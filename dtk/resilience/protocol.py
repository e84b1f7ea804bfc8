"""The run's store protocol: every key that crosses node 0's TCPStore, with who writes it and who reads it.

Two prefixes: `dtk/run/` holds what lasts the whole run (faults, nodes, the stop); `dtk/a<attempt>/` what one
attempt's processes say (one attempt = one set of rank processes; a checkpoint restart starts a new one). No key is
built anywhere else. (The seam's own prefixes, `a<attempt>/world` and `gen<g>` under it, name the gloo groups'
rendezvous, not messages: dtk.comm builds those.)
"""
from __future__ import annotations

import json
from typing import Any

import torch.distributed as dist

RUN_PREFIX = "dtk/run"


def attempt_prefix(attempt: int) -> str:
    return f"dtk/a{attempt}"


def world_prefix(attempt: int) -> str:
    """The world process group's rendezvous (dtk.worker); a fresh one per attempt (see FACTS: torchrun restarts)."""
    return f"a{attempt}/world"


def run_store(store: dist.Store) -> dist.PrefixStore:
    return dist.PrefixStore(RUN_PREFIX, store)


def attempt_store(store: dist.Store, attempt: int) -> dist.PrefixStore:
    return dist.PrefixStore(attempt_prefix(attempt), store)


def read_json(store: dist.Store, key: str) -> Any | None:
    """The JSON value of `key`, or None while nobody has written it."""
    return json.loads(store.get(key)) if store.check([key]) else None


# -- dtk/run/: the whole run --

def faults(rank: int) -> str:
    """A JSON list of the faults announced to `rank`. Written by the launcher's fault board and a test bed's driver
    (dtk.resilience.faults.announce, compare-and-set); read by the rank (Control) at start-up and while running."""
    return f"faults/{rank}"


def fired(fault_id: str) -> str:
    """A fault that fired ({kind, rank, at_step, time, ...}). Written by its rank just before it acts (Injector);
    read by the launcher (FaultBoard.fired, to name a failure) and a test bed's driver (to shape a link)."""
    return f"fired/{fault_id}"


def applied(fault_id: str) -> str:
    """A congestion is in force. Written by the test bed's driver; the rank that fired it waits for it."""
    return f"applied/{fault_id}"


def joined(node: int) -> str:
    """{host, pid, addresses, line} of node `node`'s launcher (line: the port of its NodeLine). Written by that
    launcher once it reached the store; read by node 0 (the nodes that never joined) and its NodeWatch (a node is
    watched once joined; a node named by a broken connection is called on its line)."""
    return f"joined/{node}"


def left(node: int) -> str:
    """The exit code of node `node`'s launcher at the end. Written by it; read by node 0 (who may still report) and
    NodeWatch (a node that left is not lost)."""
    return f"left/{node}"


STOPPED = "stopped"
"""{node, code, messages, failures}: a node stopped the run. Written by the first launcher that failed; read by
every other launcher, which then stops its ranks and says why."""

RESTART = "nodes/restart"
"""{attempt, placement}: node 0's latest checkpoint restart and which node runs each rank in it. Written by node 0
(Coordinator); read by the other nodes' launchers (NodeReporter)."""


def node_beat(node: int) -> str:
    """A counter node `node`'s launcher adds to every NODE_BEAT_S (NodeBeat); node 0 reads it (NodeWatch)."""
    return f"nodes/{node}/beat"


def node_lost(node: int) -> str:
    """Why node 0 took node `node` for lost. Written by node 0 (NodeWatch); read by that node (NodeBeat), which
    stops."""
    return f"nodes/{node}/lost"


def node_dead(node: int) -> str:
    """{attempt, ranks: {rank: {code, detected_at, ...}}}: node `node`'s dead ranks. Written by its launcher
    (NodeReporter); read by node 0 (Coordinator.remote_dead)."""
    return f"nodes/{node}/dead"


def replace_request(node: int, seq: int) -> str:
    """{rank, generation}: node 0 asks node `node` to replace a rank. Written by Coordinator; read by NodeReporter."""
    return f"nodes/{node}/replace/{seq}"


def replaced(node: int, seq: int) -> str:
    """How node `node` replaced the rank of request `seq` (shadow or cold). Written by NodeReporter; read by
    Coordinator."""
    return f"nodes/{node}/replaced/{seq}"


# -- dtk/a<attempt>/: one attempt's processes --

BEAT_SECONDS = 0.25
"""How often a rank writes its beat."""


def beat(rank: int) -> str:
    """{step, t, outstanding, phase, still_s, step_s, token}: `rank`'s heartbeat, every BEAT_SECONDS. Written by its
    Control thread; read by every launcher's HangWatch, and by node 0 to fence a lost node's processes (by token).
    `still_s`: how long the rank's main thread has not moved on (a new step or phase), by the rank's own clock."""
    return f"beat/{rank}"


def started(rank: int) -> str:
    """`rank`'s start-up timeline (spawned_at ... loaded_at, start_step). Written by the rank once its engine is built
    and loaded; read by the launcher (every rank started) and by the failure figures of a checkpoint restart."""
    return f"started/{rank}"


def corrupt(rank: int) -> str:
    """{step, tensors, time}: `rank`'s checksum found its state corrupt. Written by the trainer; read by nobody but
    a person (the rank then exits with CORRUPT_EXIT, which the launcher names)."""
    return f"corrupt/{rank}"


def done(rank: int) -> str:
    """The last step `rank` ran: it finished its steps. Written by the rank; read by the launcher."""
    return f"done/{rank}"


PREEMPT = "preempt"
"""The launcher got SIGTERM and checkpoints are on: every rank stops at one step boundary and saves. Written by the
supervisor; read by every rank's Control thread."""
PREEMPT_STOP_AT = "preempt/stop_at"
"""The number of committed steps at which every rank stops once preempted: the first rank to ask proposes its own
count + 2 (compare-and-set; why + 2: Control.stop_at); read by the others at every step boundary."""


def preempted(rank: int) -> str:
    """{step}: `rank` stopped and saved after SIGTERM. Written by the trainer; read by a person."""
    return f"preempted/{rank}"


def fenced(token: str) -> str:
    """Why the process `token` (host:pid) must exit: node 0 gave its rank to another process. Written by node 0
    (Coordinator.fence_lost); read by the rank's Control, which exits with FENCED_EXIT."""
    return f"fenced/{token}"


def failure(generation: int) -> str:
    """Why `generation` failed. Written by the launcher's recovery (dtk.resilience.recovery); read by every rank's
    Control thread, which releases its blocked collectives, and by the launcher (a recovery no death explains)."""
    return f"gen{generation}/failure"


def peer_errors(generation: int) -> str:
    """Lines {"rank", "peer"} appended by each rank whose connection to a peer broke in `generation` (the address
    gloo named). Written by the rank's Control; read by node 0's launcher, which maps an address to a node
    (dtk.resilience.nodes.NodeWatch): a lost host is named by its survivors before its silence is long."""
    return f"gen{generation}/peer-errors"


def plan(generation: int) -> str:
    """{source, step, replaced, record}: how every rank joins `generation`. Written by recovery; read by the ranks."""
    return f"gen{generation}/plan"


def report(generation: int, kind: str, rank: int) -> str:
    """kind "failed": `rank` saw `generation` fail ({step, valid, released_at, ...}); "rejoined": it runs in
    `generation` ({regrouped_at, repaired_at, ...}). Written by the rank; read by recovery."""
    return f"gen{generation}/{kind}/{rank}"


def shadow_ready(shadow_id: int | str) -> str:
    """A shadow built everything it could ({ready_at, ...}). Written by the shadow; read by ShadowPool."""
    return f"shadow/{shadow_id}/ready"


def shadow_promote(shadow_id: int | str) -> str:
    """{rank, generation}: the shadow takes `rank`. Written by ShadowPool.promote; the shadow waits for it."""
    return f"shadow/{shadow_id}/promote"


# -- checkpoint-shared/: before any rank starts, every node checks it sees node 0's checkpoint --

CHECKPOINT_SHARED_PREFIX = "checkpoint-shared"
CHECKPOINT_NODE0 = "node0"
"""{step, host, need}: the checkpoint node 0 resumes from. Written by node 0; read by the others."""


def checkpoint_verdict(node: int) -> str:
    """{host, problem}: whether node `node` sees node 0's checkpoint. Written by that node; read by node 0."""
    return f"verdict/{node}"
