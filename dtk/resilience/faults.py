"""Faults on purpose: a registry of what can go wrong with a rank, the `kind:rank=R,step=S[,phase=P]` spelling,
and the injector that fires a fault inside its rank at the chosen step and phase.

A fault fires once per run, even across restarts: its firing is recorded in the run's store before it acts.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from dtk.errors import DtkError
from dtk.metrics import append_event
from dtk.recipe import ResilienceConfig
from dtk.resilience.congestion import parse as parse_congestion
from dtk.resilience import protocol as keys

log = logging.getLogger(__name__)

FAULTS: dict[str, str] = {
    "kill": "SIGKILL the rank's process",
    "segv": "SIGSEGV the rank's process (a crash in native code)",
    "exit": "the rank exits with code 3",
    "hang": "the rank stays alive but stops making progress (blocked before its next collective)",
    "slow": "straggler: from that step on the rank's steps take `factor` times longer (default 3)",
    "stall": "the rank freezes for `seconds` (default 1) and goes on, as in a long pause of its process; keep it "
             "under the heartbeat timeout, or it is taken for hung",
    "corrupt": "flip one bit in one tensor of the rank's local state (caught by the state checksum)",
    "kill-host": "more than one host (--testbed H, --nnodes N): every process dtk runs on a host dies at once (its "
                 "launcher, ranks and shadows; as when the machine goes down): kill-host:host=1,step=5[,phase=P]",
    "congest": "test bed only (--testbed H): from step S shape a host's link (host=I) or one path (pair=I-J) to "
               "rate=R: congest:pair=0-1,rate=200mbit,step=5",
}
PHASES = ("forward", "backward", "optimizer", "commit", "recovery", "eval", "checkpoint")
"""optimizer: before the rank's update; commit: after its update, before it counts the step; recovery: while the
rank takes part in an in-place recovery, after the regroup and before the state is sent; eval: in the evaluation at
the boundary of S steps done (eval.every), after its first batch; checkpoint: as the rank starts saving the
checkpoint of S steps done (checkpoints/step_S; S a multiple of checkpoint.every)."""
CORRUPT_EXIT = 75
"""Exit code of a rank that found its local state corrupted."""
CONGEST_WAIT_S = 120.0
"""How long rank 0 waits at a congestion's step for the test bed's driver to have shaped the link."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    kind: str
    rank: int
    step: int | None = None
    """None: at the rank's next step."""
    phase: str = "forward"
    factor: float = 3.0
    seconds: float = 1.0
    id: str = ""

    def spec(self) -> str:
        parts = [f"rank={self.rank}"] + ([f"step={self.step}"] if self.step is not None else [])
        parts += [f"phase={self.phase}"] if self.phase != "forward" else []
        parts += [f"factor={self.factor:g}"] if self.kind == "slow" else []
        parts += [f"seconds={self.seconds:g}"] if self.kind == "stall" else []
        return f"{self.kind}:{','.join(parts)}"


def parse(spec: str, *, world: int, fault_id: str, flag: str = "--fault", hosts: int | None = None,
          nodes: int | None = None):
    """`kill:rank=1,step=20` -> Fault; `congest:pair=0-1,rate=200mbit,step=5` -> dtk.resilience.congestion.Congestion, only
    on a test bed of `hosts` hosts; `kill-host:host=1,step=5` -> a Fault of the host's first rank, on a run of
    `nodes` nodes (default: `hosts`). A bad spec raises DtkError naming the flag, the value and what is accepted."""
    kind, _, rest = spec.partition(":")
    if kind not in FAULTS:
        raise DtkError(f"{flag}: got {spec!r}; the fault must be one of {', '.join(FAULTS)}")
    if kind == "congest":  # applied on the test bed by its driver (the root namespace), never inside a rank
        congestion = parse_congestion(spec, hosts=hosts, flag=flag)
        if hosts is None:
            raise DtkError(f"{flag}: got {spec!r}; congest needs the ranks on the test bed: add --testbed H "
                           "(dtk train, dtk compare; dtk bench comm --testbed N --congest ...)")
        return congestion
    fields: dict[str, str] = {}
    keys = ("host", "rank", "step", "phase") if kind == "kill-host" else ("rank", "step", "phase", "factor", "seconds")
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in keys:
            raise DtkError(f"{flag}: got {item!r} in {spec!r}; accepted keys: {', '.join(keys)} (key=value)")
        fields[key] = value
    if kind == "kill-host":
        fields["rank"] = _host_rank(spec, fields, world=world, nodes=nodes or hosts, flag=flag)
    try:
        rank = int(fields.get("rank", "-1"))
        step = int(fields["step"]) if "step" in fields else None
        factor = float(fields.get("factor", "3"))
        seconds = float(fields.get("seconds", "1"))
    except ValueError:
        raise DtkError(f"{flag}: got {spec!r}; rank and step are whole numbers, factor and seconds numbers") from None
    if not 0 <= rank < world:
        raise DtkError(f"{flag}: got rank={fields.get('rank')} in {spec!r}; accepted: rank=0..{world - 1}")
    if step is not None and step < 0:
        raise DtkError(f"{flag}: got step={step} in {spec!r}; accepted: a step >= 0")
    phase = fields.get("phase", "forward")
    if phase not in PHASES:
        raise DtkError(f"{flag}: got phase={phase!r} in {spec!r}; accepted: {', '.join(PHASES)}")
    if factor < 1:
        raise DtkError(f"{flag}: got factor={factor:g} in {spec!r}; accepted: factor >= 1")
    if not 0 < seconds <= 3600:
        raise DtkError(f"{flag}: got seconds={seconds:g} in {spec!r}; accepted: 0 < seconds <= 3600")
    return Fault(kind=kind, rank=rank, step=step, phase=phase, factor=factor, seconds=seconds, id=fault_id)


def check_reachable(parsed: list, *, steps: int, mode: str, every: int | None = None, flag: str = "--fault") -> None:
    """A fault the run can never reach would not fire, and the chaos run would pass having tested nothing: refuse
    one aimed at step `steps` or later, at the recovery phase of a run that never recovers in place, or at the
    checkpoint phase of a step that is not a checkpoint boundary (`every`: checkpoint.every; DtkError, one line per
    fault)."""
    lines = []
    for f in parsed:
        if (isinstance(f, Fault) and f.phase == "checkpoint" and every is not None and f.step is not None
                and f.step < steps and not (every and f.step and f.step % every == 0)):
            accepted = (f"step=S, a multiple of {every} below {steps}" if every else
                        "checkpoint.every above 0")
            lines.append(f"{flag}: got step={f.step} in {f.spec()!r}; phase=checkpoint fires as the checkpoint of S "
                         f"steps done is saved, and checkpoint.every is {every}; accepted: {accepted}")
        if getattr(f, "step", None) is not None and f.step >= steps:
            what = f.spec() if isinstance(f, Fault) else f.as_fault()
            lines.append(f"{flag}: got step={f.step} in {what!r}; the run trains steps 0..{steps - 1} "
                         f"(training.steps={steps}); accepted: step=0..{steps - 1}")
        if isinstance(f, Fault) and f.phase == "recovery" and mode != "inplace":
            lines.append(f"{flag}: got phase=recovery in {f.spec()!r}; only an in-place recovery has that phase, and "
                         f"resilience.mode is {mode!r}; accepted: phase=forward, backward, optimizer or commit, or "
                         f"resilience.mode=inplace")
    if lines:
        raise DtkError(*lines)


def arm_checksums(resilience: ResilienceConfig, *, faults: list, random_kind: str | None = None) -> None:
    """A corruption must be caught, never trained on: a run given a corrupt fault (in `faults`, or random faults of
    `random_kind`) checks its state's checksum every step, unless resilience.checksum_every already says how often."""
    if random_kind == "corrupt" or any(f.kind == "corrupt" for f in faults):
        resilience.checksum_every = resilience.checksum_every or 1


def _host_rank(spec: str, fields: dict[str, str], *, world: int, nodes: int | None, flag: str) -> str:
    """kill-host names its host (host=I) or a rank it runs (rank=R, the spelling a launcher passes on); the fault
    is fired by that rank: its first rank for host=I."""
    if not nodes or nodes < 2:
        raise DtkError(f"{flag}: got {spec!r}; kill-host needs a run of more than one host (--testbed H, or --nnodes N)")
    if ("host" in fields) == ("rank" in fields):
        raise DtkError(f"{flag}: got {spec!r}; accepted: exactly one of host=I or rank=R (the host that runs rank R)")
    if "rank" in fields:
        return fields["rank"]
    try:
        host = int(fields["host"])
    except ValueError:
        host = -1
    if not 0 <= host < nodes:
        raise DtkError(f"{flag}: got host={fields['host']} in {spec!r}; accepted: host=0..{nodes - 1}")
    return str(host * (world // nodes))


def announce(run_store, fault: Fault) -> None:
    """Add a fault to its rank's list in the run's store (read at start-up and polled while running); atomic, as the
    launcher and a test bed's driver may both announce faults to a run."""
    key = keys.faults(fault.rank)
    while True:
        old = run_store.get(key).decode() if run_store.check([key]) else ""
        new = json.dumps(json.loads(old or "[]") + [asdict(fault)])
        if run_store.compare_set(key, old, new).decode() == new:
            return


@dataclass(kw_only=True)
class FaultBoard:
    """The launcher's side of faults: announces them to their ranks (given at start, live from `dtk inject-failure
    --run`, drawn at random by --mtbf) and reads back which fired, so that a failure is named by its cause."""

    run_store: dist.Store
    """The run's store prefix (dtk.resilience.protocol.run_store)."""
    run_dir: Path
    world: int
    nnodes: int = 1
    schedule: list[tuple[float, int]] = field(default_factory=list)
    """(seconds of training, rank) of random faults of kind `schedule_kind` (--mtbf)."""
    schedule_kind: str = "kill"
    steps: int = 0
    """training.steps: a live fault at or past it could never fire (check_reachable)."""
    mode: str = "none"
    """resilience.mode: phase=recovery is reachable only in place."""
    every: int | None = None
    """checkpoint.every: phase=checkpoint is reachable only at its boundaries."""
    attributed: set[str] = field(default_factory=set)
    """The fired faults already named as a failure's cause."""
    _next_random: int = 0

    def deliver(self, fault: Fault) -> None:
        """Announce a fault to its rank (read at start-up and polled while running)."""
        announce(self.run_store, fault)

    def live(self, specs: list[str], ids: list[str]) -> list[str]:
        """From `dtk inject-failure --run` (dtk.resilience.live): parse (DtkError on a bad one: nothing is scheduled)
        and deliver, each under its id."""
        parsed = [parse(s, world=self.world, fault_id=i, flag="fault", nodes=self.nnodes) for s, i in zip(specs, ids)]
        check_reachable(parsed, steps=self.steps, mode=self.mode, every=self.every, flag="fault")
        for f in parsed:
            self.deliver(f)
        append_event(self.run_dir, {"event": "faults scheduled", "faults": [f.spec() for f in parsed]})
        return [f.spec() for f in parsed]

    def fired(self) -> list[dict]:
        """The faults that have fired so far (each recorded by its rank just before it acted)."""
        announced = [f for rank in range(self.world) for f in keys.read_json(self.run_store, keys.faults(rank)) or []]
        return [x for f in announced if (x := keys.read_json(self.run_store, keys.fired(f["id"]))) is not None]

    def fired_ids(self) -> list[str]:
        """For summary.json: a chaos run whose faults did not fire tested nothing, and the CLI says so."""
        try:
            return [f["id"] for f in self.fired()]
        except dist.DistError:
            return []  # node 0's store is gone (another node's launcher, at the end)

    def attribute(self, rank: int) -> dict | None:
        """The newest fault that fired on `rank` and caused no failure yet (a straggler's `slow` causes none)."""
        fired = sorted((f for f in self.fired()
                        if f["rank"] == rank and f["id"] not in self.attributed and f["kind"] != "slow"),
                       key=lambda f: f["time"])  # fired() is in the order the faults were announced
        if not fired:
            return None
        self.attributed.add(fired[-1]["id"])
        return fired[-1]

    def random_due(self, *, t_train: float | None, resumed_at: float | None) -> None:
        """Deliver the random faults due by now (drawn in training time: from `t_train`); one that came while the run
        was recovering (before `resumed_at`) is dropped: there was no running rank for it to hit."""
        now = time.time() - (t_train or float("inf"))
        while self._next_random < len(self.schedule) and self.schedule[self._next_random][0] <= now:
            due, rank = self.schedule[self._next_random]
            if resumed_at is None or t_train is None or t_train + due < resumed_at:
                append_event(self.run_dir, {"event": "random fault dropped", "rank": rank, "due_s": due,
                                            "why": "it came during a recovery"})
            else:
                self.deliver(Fault(kind=self.schedule_kind, rank=rank, id=f"mtbf{self._next_random}"))
            self._next_random += 1


def parse_duration(text: str, flag: str) -> float:
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            number = text[: -len(unit)]
            break
    else:
        unit, number = "s", text
    try:
        value = float(number) * units[unit]
    except ValueError:
        value = -1
    if value <= 0:
        raise DtkError(f"{flag}: got {text!r}; accepted: a duration like 30s, 500ms, 2m")
    return value


def random_schedule(*, mtbf_s: float, seed: int, world: int, horizon_s: float = 24 * 3600) -> list[tuple[float, int]]:
    """(seconds after start, rank) of faults with exponential gaps of mean `mtbf_s`; deterministic by seed."""
    rng = random.Random(seed)
    t, out = 0.0, list[tuple[float, int]]()
    while len(out) < 1000:
        t += rng.expovariate(1.0 / mtbf_s)
        if t > horizon_s:
            break
        out.append((t, rng.randrange(world)))
    return out


def flip_bit(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """Flip one bit of the first element of the first non-empty tensor; returns (tensor index, bit)."""
    for i, t in enumerate(tensors):
        if t.numel():
            bits = t.detach().reshape(-1)[:1].view(torch.uint8)
            bits[0] ^= 0x10
            return i, 4
    raise RuntimeError("no state to corrupt")


class Injector:
    """Holds this rank's faults and fires each at its step and phase. Faults arrive at start and while running
    (`dtk inject-failure --run`); `fired` records in the store keep a fault from firing twice across restarts."""

    def __init__(self, *, rank: int, store, engine):
        self.rank, self.store, self.engine = rank, store, engine
        self.pending: list[Fault] = []
        self.lock = threading.Lock()
        self.slow_factor = 1.0
        self.step = 0

    def add(self, fault: Fault) -> None:
        with self.lock:
            if fault.rank == self.rank and all(f.id != fault.id for f in self.pending) and not self._fired(fault):
                self.pending.append(fault)

    def _fired(self, fault: Fault) -> bool:
        return self.store.check([keys.fired(fault.id)])

    def at(self, step: int, phase: str) -> None:
        self.step = step
        if not self.pending:
            return
        with self.lock:
            due = [f for f in self.pending if f.phase == phase and (f.step is None or f.step <= step)]
            for f in due:
                self.pending.remove(f)
        for f in due:
            self._fire(f, step)

    def _fire(self, f: Fault, step: int) -> None:
        self.store.set(keys.fired(f.id), json.dumps({**asdict(f), "at_step": step, "time": time.time()}))
        log.warning("injecting fault %s at step %d (%s)", f.spec(), step, f.phase)
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        elif f.kind == "exit":
            os._exit(3)
        elif f.kind == "kill-host":
            # the launcher first: every rank and shadow it started dies with it (their parent-death signal)
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind == "hang":
            threading.Event().wait()
        elif f.kind == "slow":
            self.slow_factor = f.factor
        elif f.kind == "stall":
            time.sleep(f.seconds)
        elif f.kind == "corrupt":
            index, bit = flip_bit(self.engine.local_state())
            log.warning("flipped bit %d of tensor %d of the local state", bit, index)
        elif f.kind == "congest":
            # The test bed's driver shapes the link when it sees this firing; waiting for it here (the other ranks
            # wait at their next collective) makes the congestion start at this step exactly.
            self.store.wait([keys.applied(f.id)], datetime.timedelta(seconds=CONGEST_WAIT_S))

    def straggle(self, compute_seconds: float) -> None:
        if self.slow_factor > 1:
            time.sleep(compute_seconds * (self.slow_factor - 1))


def checksum(tensors: list[torch.Tensor]) -> list[int]:
    """One integer per tensor: the sum of its bytes read as int32 (or uint8), so any flipped bit changes it."""
    out = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        raw = flat.view(torch.int32) if flat.element_size() == 4 else flat.view(torch.uint8)
        out.append(int(raw.sum(dtype=torch.int64)))
    return out
