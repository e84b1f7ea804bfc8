"""The launcher-side failure policy without processes: the supervisor over a fake host and torch's in-process
HashStore, with the real roles, fault board, watches and recovery sequence. What a rank would write (fired faults,
beats, started marks, reports) is written into the store by the test."""
from __future__ import annotations

import json
import threading
import time

import pytest
import torch.distributed as dist

from dtk import recipe as recipes
from dtk.resilience import nodes
from dtk.resilience import protocol as keys
from dtk.resilience.faults import FaultBoard
from dtk.resilience.recovery import RunState
from dtk.resilience.roles import FollowerNode, LeadNode, LocalView, SingleNode, absent_line
from dtk.resilience.supervisor import Supervisor

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class FakeHost:
    """Ranks as exit codes the test sets; what the supervisor asks of it is recorded."""

    def __init__(self, ranks: list[int]):
        self.codes: dict[int, int | None] = {r: None for r in ranks}
        self.starts: list[tuple[int, list[int] | None]] = []
        self.replaced: list[tuple[int, int]] = []
        self.killed: list[int] = []
        self.stops: list[float] = []
        self.replenished = 0

    def ranks(self) -> list[int]:
        return sorted(self.codes)

    def exit_codes(self) -> dict[int, int | None]:
        return dict(self.codes)

    def dead(self) -> list[int]:
        return [r for r, c in self.codes.items() if c not in (None, 0)]

    def replace(self, rank: int, generation: int) -> dict:
        self.replaced.append((rank, generation))
        self.codes[rank] = None
        return {"replacement": "cold", "pid": 0, "why": "fake"}

    def kill(self, rank: int) -> None:
        self.killed.append(rank)
        self.codes[rank] = -9

    def start(self, *, attempt: int, control: dist.Store, hosted: list[int] | None) -> None:
        self.starts.append((attempt, hosted))
        self.codes = {r: None for r in self.codes}

    def stop_all(self, grace_s: float = 3.0) -> None:
        self.stops.append(grace_s)

    def replenish_shadows(self) -> list[int]:
        self.replenished += 1
        return []


class Progress:
    def update(self) -> None:
        pass


def make(tmp_path, *overrides: str, nnodes: int = 1, node: int = 0, steps_done: int = 4):
    recipe = recipes.build({}, ["world.nproc=2", *overrides])
    run_dir = tmp_path / f"node{node}"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0, "time": 0.0}) + "\n"
                                                   for s in range(steps_done)))
    store = dist.HashStore()
    run_store = keys.run_store(store)
    world = 2 * nnodes
    host = FakeHost(list(range(2 * node, 2 * node + 2)))
    state = RunState()
    local = LocalView(processes=host, state=state, run_dir=run_dir)
    recovers = recipe.resilience.mode in ("inplace", "checkpoint")
    if nnodes == 1:
        role = SingleNode(view=local, nproc=2)
    elif node == 0:
        role = LeadNode(local=local, state=state, run_store=run_store, nnodes=nnodes, nproc=2, coordinate=recovers)
    else:
        role = FollowerNode(view=local, run_store=run_store, node=node, nnodes=nnodes, nproc=2, report=recovers)
    board = FaultBoard(run_store=run_store, run_dir=run_dir, world=world, nnodes=nnodes)
    sup = Supervisor(recipe=recipe, run_dir=run_dir, host=host, role=role, board=board, state=state, store=store,
                     world=world, node=node,
                     absent_line=lambda ns: absent_line(ns, nproc=2, timeout_s=1, nnodes=nnodes, address="x:1"))
    sup.start_attempt(0)
    for r in range(world):  # every rank has built its engine
        sup.control.set(keys.started(r), json.dumps({"start_step": 0}))
    return sup, host, run_store


def fire(run_store, *, rank: int, kind: str, fault_id: str, at_step: int) -> None:
    """What a rank's injector writes before it acts."""
    spec = {"kind": kind, "rank": rank, "step": at_step, "phase": "forward", "factor": 3.0, "seconds": 1.0,
            "id": fault_id}
    old = json.loads(run_store.get(keys.faults(rank))) if run_store.check([keys.faults(rank)]) else []
    run_store.set(keys.faults(rank), json.dumps(old + [spec]))
    run_store.set(keys.fired(fault_id), json.dumps({**spec, "at_step": at_step, "time": time.time()}))


def test_a_death_is_named_by_the_fault_that_fired_once_and_mode_none_stops(tmp_path):
    sup, host, run_store = make(tmp_path, "resilience.mode=none")
    fire(run_store, rank=1, kind="kill", fault_id="f0", at_step=3)
    host.codes[1] = -9
    assert sup.watch(Progress()) == 1
    [f] = sup.failures
    assert (f["rank"], f["fault"], f["step"], f["fault_spec"], f["exit"]) == (1, "kill", 3, "f0", "killed by SIGKILL")
    assert sup.messages[0] == "error: rank 1 failed (kill); the run is stopped."
    assert host.stops == [3.0]
    # the same firing never names a second failure: the next death of rank 1 is its exit status
    assert sup.board.attribute(1) is None


def test_checkpoint_restarts_until_a_storm_stops_the_run(tmp_path):
    sup, host, _ = make(tmp_path, "resilience.mode=checkpoint", "checkpoint.every=2", "resilience.max_failures=50")
    for attempt in range(1, 6):
        host.codes[0] = 3
        assert sup._handle_failure([0]) is (attempt < 5)
        for r in range(2):  # the new attempt's ranks start
            sup.control.set(keys.started(r), json.dumps({"start_step": 0}))
    assert [a for a, _ in host.starts] == [0, 1, 2, 3, 4]  # attempt 0, then one restart per failure but the last
    assert [f.get("restart_attempt") for f in sup.failures] == [1, 2, 3, 4, None]
    assert sup.failures[0]["fault"] == "exit code 3" and sup.failures[0]["recovery"] == "checkpoint restart"
    assert sup.messages[0].startswith("error: failures come faster than recovery makes progress: 5 in a row")


def test_in_place_falls_back_on_the_checkpoint_when_no_survivor_holds_the_state(tmp_path):
    sup, host, _ = make(tmp_path, "resilience.mode=inplace", "checkpoint.every=10")
    # the survivor's report says its state is not whole: nobody can be the plan's source
    sup.control.set(keys.report(0, "failed", 0), json.dumps({"step": 4, "valid": False}))
    host.codes[1] = -9
    assert sup._handle_failure([1]) is True
    assert host.replaced == [(1, 1)]  # the recovery gave rank 1 a process before it found no source
    assert host.starts[-1] == (1, None)  # then the whole run restarted from the checkpoint: attempt 1
    [f] = sup.failures
    assert f["recovery"] == "checkpoint restart" and sup.state.attempt == 1
    assert sup.control.check([keys.failure(0)]) is False  # attempt 1's prefix: a fresh generation 0
    events = [json.loads(line) for line in (sup.run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "in-place recovery failed" for e in events)


def test_in_place_recovery_moves_the_run_to_the_next_generation(tmp_path):
    sup, host, _ = make(tmp_path, "resilience.mode=inplace")
    sup.control.set(keys.report(0, "failed", 0), json.dumps({"step": 4, "released_at": time.time(), "engine_id": 7}))
    for r in range(2):  # both ranks rejoin generation 1 (rank 1 is the replacement)
        sup.control.set(keys.report(1, "rejoined", r), json.dumps(
            {"step": 4, "engine_id": 7, "regrouped_at": time.time(), "repaired_at": time.time(), "regroup_s": 0.0,
             "replacement": r == 1, "repair_bytes": 10, "ready_at": time.time()}))
    host.codes[1] = -9
    assert sup._handle_failure([1]) is True
    assert sup.state.generation == 1 and host.replaced == [(1, 1)]
    plan = json.loads(sup.control.get(keys.plan(1)))
    assert (plan["source"], plan["step"], plan["replaced"]) == (0, 4, [1])
    [f] = sup.failures
    assert (f["generation"], f["source_rank"], f["steps_lost"]) == (0, 0, 0)
    # the promoted shadow is replaced only once every rank's beat is past the interrupted step (step 4)
    for step, replenished in ((4, 0), (5, 1)):
        for r in range(2):
            sup.control.set(keys.beat(r), json.dumps({"step": step, "t": time.time(), "outstanding": 0,
                                                      "phase": "train"}))
        sup.hangs._next_poll = 0.0
        sup.hangs.check(sup.control, [0, 1])
        sup._replenish_when_redone()
        assert host.replenished == replenished


def test_a_silent_node_is_lost_its_ranks_fenced_and_mode_none_stops(tmp_path, monkeypatch):
    monkeypatch.setattr(nodes, "NODE_SILENT_S", 0.3)
    sup, host, run_store = make(tmp_path, "resilience.mode=none", nnodes=2)
    run_store.set(keys.joined(1), "{}")
    run_store.add(keys.node_beat(1), 1)  # node 1 beat once, then went silent
    assert sup.watch(Progress()) == 1
    assert sup.messages[0].startswith("error: node 1 (ranks 2-3) went silent")
    assert [(f["rank"], f["fault"], f["node_lost"]) for f in sup.failures] == [(2, "host lost", 1),
                                                                               (3, "host lost", 1)]
    assert run_store.check([keys.node_lost(1)])  # node 1 reads it and stops its ranks, if it was only cut off


def broke(sup, *, rank: int, peer: str) -> None:
    """What a rank's control thread posts when gloo says its connection to `peer` broke."""
    sup.control.append(keys.peer_errors(sup.state.generation), json.dumps({"rank": rank, "peer": peer}) + "\n")


@pytest.mark.timeout(20)
def test_a_node_named_by_a_broken_connection_is_lost_once_silent_and_a_live_one_is_kept(tmp_path, monkeypatch):
    # silence alone would take 30 s here: the broken connection is what finds the host lost
    monkeypatch.setattr(nodes, "NODE_SILENT_S", 30.0)
    monkeypatch.setattr(nodes, "NODE_SUSPECT_S", 30.0)
    sup, host, run_store = make(tmp_path, "resilience.mode=none", nnodes=3)
    for k, address in ((1, "10.9.0.2"), (2, "10.9.0.3")):
        run_store.set(keys.joined(k), json.dumps({"addresses": [address, "fe80::2"]}))  # fe80::2: on both, no one's
    broke(sup, rank=0, peer="fe80::2")
    broke(sup, rank=1, peer="10.9.0.2")
    broke(sup, rank=1, peer="10.9.0.3")
    beating = threading.Event()

    def beat_node_2():  # node 2's launcher is alive (its rank died, say): it keeps beating
        while not beating.wait(0.05):
            run_store.add(keys.node_beat(2), 1)

    beater = threading.Thread(target=beat_node_2, daemon=True)
    beater.start()
    run_store.add(keys.node_beat(1), 1)  # node 1 beat once, then its host went down
    try:
        assert sup.watch(Progress()) == 1
    finally:
        beating.set()
        beater.join()
    assert sup.messages[0].startswith("error: node 1 (ranks 2-3) went silent")
    assert [(f["rank"], f["node_lost"], f["detected_by"], f["node_address"]) for f in sup.failures] == [
        (2, 1, "connection error", "10.9.0.2"), (3, 1, "connection error", "10.9.0.2")]
    assert nodes.NODE_BROKEN_S < sup.failures[0]["node_silent_s"] < 30.0
    assert "connection to this node (10.9.0.2) broke" in run_store.get(keys.node_lost(1)).decode()
    assert not run_store.check([keys.node_lost(2)])  # named too, but it beat: never fenced


@pytest.mark.timeout(20)
def test_a_node_whose_held_line_drops_and_refuses_is_lost_with_no_rank_named_it(tmp_path, monkeypatch):
    # node 0 holds a connection to each node's line; node 1's launcher dies (its line closes with its process)
    # while no rank has reached a collective with it yet: the dropped line, confirmed by a refused call, finds it
    for name in ("NODE_SILENT_S", "NODE_SUSPECT_S", "NODE_BROKEN_S"):
        monkeypatch.setattr(nodes, name, 30.0)
    sup, host, run_store = make(tmp_path, "resilience.mode=none", nnodes=3)
    lines = {1: nodes.NodeLine(), 2: nodes.NodeLine()}
    for k, line in lines.items():
        run_store.set(keys.joined(k), json.dumps({"addresses": [f"127.0.0.{k + 1}"], "line": line.port}))
        run_store.add(keys.node_beat(k), 1)

    def launcher_1_dies():
        deadline = time.monotonic() + 5
        while not lines[1].held and time.monotonic() < deadline:  # node 0 holds its line...
            lines[1].answer()
            time.sleep(0.01)
        lines[1].close()  # ...then its process ends

    dying = threading.Thread(target=launcher_1_dies, daemon=True)
    dying.start()
    try:
        assert sup.watch(Progress()) == 1
    finally:
        dying.join()
        lines[2].close()
    [f] = {(f["node_lost"], f["detected_by"], f["node_refused"], f["node_address"]) for f in sup.failures}
    assert f == (1, "connection error", True, "127.0.0.2")
    assert "node 0's line to this node (127.0.0.2) broke" in run_store.get(keys.node_lost(1)).decode()
    assert not run_store.check([keys.node_lost(2)])


def test_a_node_that_beat_irregularly_is_given_a_longer_silence(tmp_path):
    watch = nodes.NodeWatch(run_store=keys.run_store(dist.HashStore()), nnodes=2)
    assert watch.broken_wait(1) == nodes.NODE_BROKEN_S
    watch.longest_gap[1] = 0.5  # a loaded machine: its launcher was once silent for half a second
    assert watch.broken_wait(1) == 0.5 * nodes.BROKEN_GAPS
    watch.longest_gap[1] = 5.0
    assert watch.broken_wait(1) == nodes.NODE_SUSPECT_S


def test_the_lead_fences_a_lost_nodes_processes_by_their_token(tmp_path, monkeypatch):
    monkeypatch.setattr(nodes, "NODE_SILENT_S", 0.3)
    sup, host, run_store = make(tmp_path, "resilience.mode=inplace", nnodes=2)
    run_store.set(keys.joined(1), "{}")
    sup.control.set(keys.beat(3), json.dumps({"step": 4, "token": "hostB:123", "outstanding": 0}))
    deadline = time.monotonic() + 5
    while not (lost := sup.role.lost_nodes(suspect=lambda: False, active=lambda n: True, named=list)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert lost == [1] and sup.role.remote_failed() == [2, 3]
    assert "gave rank 3 to another process" in sup.control.get(keys.fenced("hostB:123")).decode()


def test_a_follower_told_it_was_lost_stops_its_ranks_without_stopping_the_run(tmp_path):
    sup, host, run_store = make(tmp_path, "resilience.mode=inplace", nnodes=2, node=1)
    run_store.set(keys.node_lost(1), "node 0 heard nothing from this node's launcher for 3.0s and took it for lost")
    assert sup.watch(Progress()) == 1
    assert host.stops == [0.0] and sup.fenced
    assert sup.messages[0].startswith("error: node 0 heard nothing")
    sup.role.leave(1, fenced=sup.fenced, messages=sup.messages, failures=sup.failures)
    assert not run_store.check([keys.STOPPED]) and run_store.get(keys.left(1)) == b"1"


def test_a_follower_reports_a_death_to_node_0_instead_of_acting(tmp_path):
    sup, host, run_store = make(tmp_path, "resilience.mode=inplace", nnodes=2, node=1)
    host.codes[3] = -9
    sup._poll_ranks()
    assert sup.role.tend(sup._replace_for_node0, sup.reported_dead) is None
    reported = json.loads(run_store.get(keys.node_dead(1)))
    assert list(reported["ranks"]) == ["3"] and reported["ranks"]["3"]["code"] == -9
    assert sup.failures == [] and host.replaced == []
