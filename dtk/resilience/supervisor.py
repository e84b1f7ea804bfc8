"""The supervisor of one node's share of a run: the watch loop (deaths, hangs, silent nodes, random faults) and the
failure policy (recover in place, restart from a checkpoint, stop; storms; fencing; a fallback to the checkpoint).

It acts on the run through a `Host` (this node's processes: dtk.launch.Host) and hears the other nodes through a
`NodeRole` (dtk.resilience.roles); both are Protocols, so the policy runs as well over a fake host (tests/unit).
"""
from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path
from typing import Callable, Protocol

import torch.distributed as dist

from dtk import recipe as recipes
from dtk.metrics import append_event
from dtk.resilience import checkpoint
from dtk.resilience import protocol as keys
from dtk.resilience.failures import (CheckpointRestart, FailureRecord, committed_steps, describe_failure,
                                     lost_during_recovery)
from dtk.resilience.faults import FaultBoard
from dtk.resilience.nodes import NodeLoss
from dtk.resilience.recovery import RecoveryFailed, RunState, RunView, recover_in_place
from dtk.resilience.roles import nodes_named
from dtk.resilience.watches import HangWatch, StormWatch, signal_name
from dtk.rundir import tail

log = logging.getLogger(__name__)
POLL_SECONDS = 0.02
REPLENISH_WAIT_S = 30.0
"""After an in-place recovery, the longest the used shadows' replacements wait for the redo to finish."""
PREEMPT_WAIT_S = 120.0
"""After SIGTERM, how long the ranks may take to finish their step and save it before they are stopped."""
SIGTERM_EXIT = 128 + signal.SIGTERM


class Host(Protocol):
    """What the supervisor may do with this node's processes."""

    def ranks(self) -> list[int]:
        """The ranks this node runs now."""

    def exit_codes(self) -> dict[int, int | None]:
        """rank -> its exit status, None while it runs."""

    def dead(self) -> list[int]:
        """Ranks whose process has exited without success."""

    def replace(self, rank: int, generation: int) -> dict: ...

    def kill(self, rank: int) -> None: ...

    def start(self, *, attempt: int, control: dist.Store, hosted: list[int] | None) -> None:
        """Start the ranks (and shadows) of `attempt`: `hosted`, else those this node ran so far."""

    def stop_all(self, grace_s: float = 3.0) -> None: ...

    def replenish_shadows(self) -> list[int]: ...


class NodeRole(Protocol):
    """What the supervisor hears from the other nodes (dtk.resilience.roles: SingleNode, LeadNode, FollowerNode)."""

    view: RunView
    coordinates: bool
    """Node 0 of several, in place or checkpoint: the view is the whole run, other nodes' deaths come here."""
    reports: bool
    """Another node, in place or checkpoint: node 0 recovers this node's ranks."""

    def stopped_elsewhere(self) -> dict | None: ...

    def never_joined(self, *, since: float, timeout_s: float) -> list[int]: ...

    def absent_now(self) -> list[int]: ...

    def fenced(self) -> str | None: ...

    def lost_nodes(self, *, suspect: Callable[[], bool], active: Callable[[int], bool],
                   named: Callable[[], list[str]]) -> list[int]: ...

    def ranks_of(self, node: int) -> list[int]: ...

    def lost_node_of(self, rank: int) -> int | None: ...

    def loss(self, node: int) -> NodeLoss | None:
        """Why node 0 took `node` for lost (None: it did not)."""

    def remote_death(self, rank: int) -> dict: ...

    def remote_failed(self) -> list[int]:
        """Node 0 coordinating: the other nodes' dead ranks (reported, or lost with their node)."""

    def tend(self, replace: Callable[[int, int], dict], dead: dict[int, dict]) -> tuple[int, list[int]] | None:
        """Another node reporting: node 0's new restart (attempt, ranks), else report `dead` and serve `replace`."""

    def follow(self, attempt: int) -> None: ...

    def announce_restart(self, attempt: int) -> list[int] | None:
        """A checkpoint restart starts: the ranks this node runs in it (None: the same as before)."""

    def leave(self, code: int, *, fenced: bool, messages: list[str], failures: list[FailureRecord]) -> None:
        """The run is over on this node: tell the others (and node 0 waits a while for them)."""


class Progress(Protocol):
    def update(self) -> None: ...


class Supervisor:
    """Watches this node's ranks and decides what the run does when one fails. `watch()` returns the exit code."""

    def __init__(self, *, recipe: recipes.Recipe, run_dir: Path, host: Host, role: NodeRole, board: FaultBoard,
                 state: RunState, store: dist.Store, world: int, node: int, absent_line: Callable[[list[int]], str]):
        self.recipe, self.run_dir, self.host, self.role, self.board = recipe, run_dir, host, role, board
        self.state, self.store, self.world, self.node = state, store, world, node
        self.absent_line = absent_line
        """Node 0's line for nodes that never joined (dtk.resilience.roles.absent_line)."""
        self.hangs = HangWatch(fixed_s=recipe.resilience.heartbeat_timeout_s)
        self.storm = StormWatch()
        self.failures: list[FailureRecord] = []
        self.messages: list[str] = []
        self.remote_failures: list[FailureRecord] = []
        """Failures another node's launcher reported when it stopped the run (multi-node)."""
        self.reported_dead: dict[int, dict] = {}
        """A follower's dead ranks, for node 0 to recover: rank -> {code, detected_at[, hang_detected_at]}."""
        self.fenced = False
        self.sigterm = False
        """Set from the launcher's SIGTERM handler; acted on by the watch loop, between two of its decisions (never
        mid-recovery)."""
        self.t_start = time.time()
        self.t_train: float | None = None
        self.resumed_at: float | None = None
        self._all_started = False
        self.replenish_after: tuple[int, float] | None = None
        """After an in-place recovery: (the step every rank must have finished, the monotonic time at which the
        shadows are started anyway) before the promoted shadows are replaced (`_replenish_when_redone`)."""

    # -- the attempt --
    def start_attempt(self, attempt: int, hosted: list[int] | None = None) -> None:
        """Start every rank (and the shadows) of an attempt; attempt 0 is the run's start, later ones restarts."""
        if attempt or self.state.control is None:
            self.state.attempt, self.state.generation = attempt, 0
            self.state.control = keys.attempt_store(self.store, attempt)
            self.hangs.reset()
            self._all_started = False
            self.replenish_after = None  # the attempt starts its own shadows
        if attempt and hosted is None:
            hosted = self.role.announce_restart(attempt)  # node 0 of several: every node restarts with it
        self.host.start(attempt=attempt, control=self.control, hosted=hosted)

    @property
    def control(self) -> dist.Store:
        assert self.state.control is not None
        return self.state.control

    def finished(self, rank: int) -> bool:
        return self.control.check([keys.done(rank)])

    def started(self) -> bool:
        """Every rank of this attempt has built its engine (remembered: the supervisor asks 50 times a second)."""
        if not self._all_started:
            self._all_started = all(self.control.check([keys.started(q)]) for q in self.host.ranks())
        return self._all_started

    # -- the watch loop --
    def watch(self, progress: Progress) -> int:
        next_progress, next_remote = 0.0, 0.0
        while True:
            if self.sigterm:
                return self._preempt()
            if time.monotonic() >= next_progress:  # the ranks need the CPU more than the progress line does
                progress.update()
                next_progress = time.monotonic() + 0.2
                if stop := self.role.stopped_elsewhere():
                    return self._follow_stop(stop)
                if absent := self.role.never_joined(since=self.t_start, timeout_s=self.recipe.world.timeout_s):
                    self._stop([], self.absent_line(absent))
                    return 1
            self._random_faults()
            running, failed = self._poll_ranks()
            if failed is not None and not self._handle_failure(failed):
                return 1
            if said := self.role.fenced():
                return self._fence(said)
            if silent := self.role.lost_nodes(suspect=self._peer_gone_unknown, active=self._node_active,
                                              named=self._broken_peers):
                if not self.role.coordinates:  # resilience.mode=none: nothing takes the lost ranks
                    return self._stop_for_lost_nodes(silent)
                next_remote = 0.0  # their ranks are dead now (Coordinator.dead): recovered below
            if self.role.reports:
                if restart := self.role.tend(self._replace_for_node0, self.reported_dead):
                    self._follow_restart(*restart)
                    continue
            elif self.role.coordinates and time.monotonic() >= next_remote:
                next_remote = time.monotonic() + 0.1
                remote = [r for r in self.role.remote_failed() if not self.finished(r)]
                if remote:
                    if not self._handle_failure(sorted(set(remote) | {r for r in self.host.dead()
                                                                      if not self.finished(r)})):
                        return 1
                    continue
            if not running:
                progress.update()
                return 0
            if self.started():
                # every node reads every rank's beat: ranks waiting on a hung peer of another node are not hung
                for rank in self.hangs.check(self.control, list(range(self.world))):
                    if rank in self.host.ranks():
                        self.host.kill(rank)  # a hung rank is removed; its death is then handled as any other
                self._replenish_when_redone()
            time.sleep(POLL_SECONDS)

    def _preempt(self) -> int:
        """SIGTERM (Slurm, Kubernetes): like Ctrl-C, but with checkpoints on, every rank first finishes its step and
        saves it (dtk.trainer), so that a preempted job loses nothing."""
        saving = bool(self.recipe.checkpoint.every) and self.started()
        append_event(self.run_dir, {"event": "interrupted", "by": "SIGTERM", "saving": saving})
        if saving:
            self.control.set(keys.PREEMPT, "1")
            deadline = time.monotonic() + PREEMPT_WAIT_S
            while time.monotonic() < deadline and None in self.host.exit_codes().values():
                time.sleep(POLL_SECONDS)
        self.host.stop_all()
        return SIGTERM_EXIT

    def _random_faults(self) -> None:
        if self.started() and self.resumed_at is None:
            self.resumed_at = time.time()  # training (re)started: random faults may land again
        if self.t_train is None and self.started():
            self.t_train = time.time()  # random faults are drawn in training time, not start-up time
        self.board.random_due(t_train=self.t_train, resumed_at=self.resumed_at)

    def _poll_ranks(self) -> tuple[bool, list[int] | None]:
        """(some rank still runs, the ranks to handle as failed now or None)."""
        running = False
        for rank, code in self.host.exit_codes().items():
            if code is None:
                running = True
            elif code != 0 and not self.finished(rank):
                if self.role.reports:  # node 0 recovers it: report it (NodeRole.tend), keep waiting
                    death: dict = {"code": code, "detected_at": time.time()}
                    if rank in self.hangs.hung:  # node 0 may not have seen it stall: say it was found hung here
                        death["hang_detected_at"] = self.hangs.hung[rank]
                    self.reported_dead.setdefault(rank, death)
                    running = True
                    continue
                return True, sorted(r for r in self.role.view.dead() if not self.finished(r))
            elif code != 0:
                log.warning("rank %d finished its steps, then exited with %s (teardown); run kept", rank,
                            signal_name(code))
        return running, None

    def _peer_gone_unknown(self) -> bool:
        """Ranks recover while no failure is announced: their collectives to a peer broke, and no death explains it
        (a lost host's ranks cannot be reported dead)."""
        return self.hangs.recovering() and not self.control.check([keys.failure(self.state.generation)])

    def _broken_peers(self) -> list[str]:
        """The addresses the ranks' broken connections named in this generation (dtk.comm.seam.broken_peer)."""
        key = keys.peer_errors(self.state.generation)
        if not self.control.check([key]):
            return []
        return sorted({json.loads(line)["peer"] for line in self.control.get(key).decode().splitlines() if line})

    def _node_active(self, node: int) -> bool:
        """Some rank that `node` runs has not finished (a node whose ranks are all done is not watched)."""
        return any(not self.finished(r) for r in self.role.ranks_of(node))

    # -- naming a failure --
    def _exit_code(self, rank: int) -> int | None:
        """None: the rank was on a lost node (nobody saw it exit)."""
        codes = self.host.exit_codes()
        if rank in codes:
            return codes[rank]
        return self.role.remote_death(rank).get("code")  # a rank of another node (node 0 coordinates)

    def _describe(self, rank: int, *, code: int | None, t_detect: float) -> FailureRecord:
        local = rank in self.host.ranks()
        lost_node = None if local else self.role.lost_node_of(rank)
        hung_at = None
        if lost_node is None:  # a lost node's ranks stall too; another node's rank: found hung by its node
            hung_at = self.hangs.hung.get(rank) if rank in self.hangs.hung or local else \
                self.role.remote_death(rank).get("hang_detected_at")
        return describe_failure(rank=rank, code=code, t_detect=t_detect, attempt=self.state.attempt,
                                generation=self.state.generation, committed=committed_steps(self.run_dir),
                                fired=self.board.attribute(rank), lost_node=lost_node,
                                node_loss=self.role.loss(lost_node) if lost_node is not None else None,
                                hung_at=hung_at)

    # -- the policy --
    def _handle_failure(self, ranks: list[int]) -> bool:
        """Ranks died (usually one). Returns True when the run goes on (recovered), False when it stops."""
        t_detect = time.time()
        r = self.recipe.resilience
        records = [self._describe(q, code=self._exit_code(q), t_detect=t_detect) for q in ranks]
        host_down = {f.node_lost: f.fault_time for f in records if f.node_lost is not None and f.fault_time}
        for f in records:  # the ranks of a host killed on purpose died when it was killed
            if f.fault_time is None and f.node_lost in host_down:
                f.fault_time = host_down[f.node_lost]
        what = " and ".join(f"rank {f.rank} failed ({f.fault})" for f in records)
        # progress that a recovery keeps: committed steps in place, the latest checkpoint for a restart
        kept = (checkpoint.latest(self.run_dir) or (0, None))[0] if r.mode == "checkpoint" else records[0].committed
        self.storm.failed(committed=kept, t_detect=t_detect)
        if (stop := self._verdict(what, len(records))) is not None:
            return self._stop(records, stop)
        if r.mode == "checkpoint":
            return self._restart(records, t_detect=t_detect, action="restarted from checkpoint")
        return self._recover(records, ranks, what=what, t_detect=t_detect)

    def _verdict(self, what: str, count: int) -> str | None:
        """The line that stops the run, or None when it may recover."""
        r = self.recipe.resilience
        if r.mode == "none":
            return f"error: {what}; the run is stopped."
        if len(self.failures) + count > r.max_failures:
            return f"error: {what} (resilience.max_failures={r.max_failures} reached); the run is stopped."
        if not self.started():
            # before every rank has started, the others are still in their first rendezvous: nothing to keep
            if absent := self.role.absent_now():
                return self.absent_line(absent)  # the rendezvous timed out because a node never came: say which
            return f"error: {what} before every rank started; the run is stopped."
        if verdict := self.storm.verdict([f.in_place.recovery_s for f in self.failures if f.in_place is not None]):
            return f"error: {verdict}."
        return None

    def _recover(self, records: list[FailureRecord], ranks: list[int], *, what: str, t_detect: float) -> bool:
        try:
            generation, figures = recover_in_place(self.role.view, failed=set(ranks), t_detect=t_detect)
        except RecoveryFailed as e:
            append_event(self.run_dir, {"event": "in-place recovery failed", "ranks": ranks, "why": str(e)})
            if self.recipe.checkpoint.every:
                return self._restart(records, t_detect=t_detect,
                                     action=f"in-place recovery failed ({e}); restarted from checkpoint")
            return self._stop(records, f"error: {what}, and in-place recovery failed: {e}; the run is "
                                       f"stopped (set checkpoint.every to fall back on a checkpoint).")
        self.state.generation = generation
        for extra in sorted(set(figures.lost_ranks) - set(ranks)):  # lost while recovering
            records.append(lost_during_recovery(extra, like=records[0], attempt=self.state.attempt,
                                                generation=generation, t_detect=t_detect))
        for f in records:
            f.recovered_in_place(figures)
            self.failures.append(f)
            append_event(self.run_dir, {"event": "failure", **f.to_dict(), "action": "recovered in place"})
        self._replenish_later(max([f.step for f in records if f.step is not None], default=-1))
        self.hangs.reset()  # the replacement's heartbeats start afresh
        self.resumed_at = time.time()
        return True

    def _replenish_later(self, failed_step: int) -> None:
        """Replace the promoted shadows once every rank has finished the step the failure interrupted, not at once:
        a shadow's start-up (imports, build, rehearsal) takes CPU from the ranks while they redo the steps the
        failure cost. On 2 shared cores it made the redo 1.6x longer (0.52-0.54 s against 0.32-0.35 s, fsdp, 3.2M
        GPT) and the replacement's first steps look cold; the shadows' idle wait afterwards costs nothing. A second
        failure inside that window gets a cold start (a shadow started then would not be ready either)."""
        step = max(failed_step, self.hangs.furthest_step())  # read before the watch is reset
        self.replenish_after = (step, time.monotonic() + REPLENISH_WAIT_S)

    def _replenish_when_redone(self) -> None:
        if self.replenish_after is None:
            return
        step, deadline = self.replenish_after
        if self.hangs.all_past(step, list(range(self.world))) or time.monotonic() >= deadline:
            self.replenish_after = None
            for sid in self.host.replenish_shadows():  # in the background: the run never waits for a shadow
                log.info("shadow %d started to replace the one promoted (the redo of step %d is done)", sid, step)

    def _restart(self, records: list[FailureRecord], *, t_detect: float, action: str) -> bool:
        """The baseline: stop every rank, start them all again; they reload the latest checkpoint and redo steps."""
        self.host.stop_all(grace_s=0.0)  # a failed attempt's ranks have nothing to save: SIGKILL, as a crash would
        t_stopped = time.time()
        found = checkpoint.latest(self.run_dir)
        self.start_attempt(self.state.attempt + 1)
        restart = CheckpointRestart(stopped_at=t_stopped, restart_attempt=self.state.attempt,
                                    checkpoint_step=found[0] if found else 0)
        self.resumed_at = None  # set again once every rank has started
        for f in records:
            f.restarted(restart)
            self.failures.append(f)
            append_event(self.run_dir, {"event": "failure", **f.to_dict(), "action": action})
        return True

    def _stop(self, records: list[FailureRecord], message: str) -> bool:
        self.host.stop_all()
        for f in records:
            self.failures.append(f)
            append_event(self.run_dir, {"event": "failure", **f.to_dict(), "action": "stopped", "why": message})
        self.messages.append(message)
        for f in records:
            if f.node_lost is not None:
                continue  # its log is on the lost host
            log_path = self.run_dir / "logs" / f"rank{f.rank}.log"
            self.messages.append(f"  last lines of {log_path}:")
            self.messages += [f"    {line}" for line in tail(log_path)]
        return False

    # -- the other nodes --
    def _replace_for_node0(self, rank: int, generation: int) -> dict:
        how = self.host.replace(rank, generation)
        self._replenish_later(-1)
        self.hangs.reset()  # the replacement's heartbeats start afresh
        return how

    def _follow_restart(self, attempt: int, hosted: list[int]) -> None:
        """Node k > 0: node 0 restarted the run from a checkpoint: stop this node's ranks, start those it runs now."""
        self.host.stop_all(grace_s=0.0)
        self.reported_dead.clear()
        self.role.follow(attempt)
        self.start_attempt(attempt, hosted=hosted)
        append_event(self.run_dir, {"event": "restart followed", "node": self.node, "attempt": attempt,
                                    "ranks": hosted})

    def _fence(self, said: str) -> int:
        """Node 0 took this node for lost (it did not hear it for a while) and gives its ranks to other nodes: stop
        them, so that no rank runs twice, and end without stopping the run."""
        self.host.stop_all(grace_s=0.0)
        self.fenced = True
        self.messages.append(f"error: {said}; this node's ranks are stopped (node 0 recovers them elsewhere).")
        return 1

    def _stop_for_lost_nodes(self, nodes: list[int]) -> int:
        who = nodes_named(nodes, nproc=self.recipe.world.nproc)
        losses = [loss for k in nodes if (loss := self.role.loss(k)) is not None]
        silent = max(loss.silent_s for loss in losses)
        broke = ", and a rank's connection to it broke" if any(loss.address for loss in losses) else ""
        broke += " and its launcher's line refused node 0's call" if any(loss.refused for loss in losses) else ""
        t_detect = time.time()
        records = [self._describe(q, code=None, t_detect=t_detect) for k in nodes for q in self.role.ranks_of(k)]
        self._stop(records, f"error: {who} went silent (its launcher was not heard for {silent:.1f}s{broke}: the host "
                            f"is lost or cut off); the run is stopped; resilience.mode=inplace or checkpoint carries on "
                            f"with its ranks on the other hosts.")
        return 1

    def _follow_stop(self, stop: dict) -> int:
        self.host.stop_all()
        self.remote_failures = [FailureRecord.from_dict(f) for f in stop["failures"]]  # figured by their node already
        other = stop["node"]
        self.messages.append(f"error: node {other} stopped the run, so this node's ranks are stopped; node {other} "
                             "said:")
        self.messages += [f"  {line}" for line in stop["messages"]]
        return 1
