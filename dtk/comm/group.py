"""The seam: dtk's process-group backend. It wraps the real backend (gloo on CPU, NCCL on CUDA), counts bytes
and seconds per collective, can rebuild its inner group in place, and never lets a failed collective raise
into a strategy (the step is marked failed instead, and the trainer does not commit it).

Every strategy (DDP, FSDP2, DeepSpeed ZeRO) talks to the other ranks only through a `DtkGroup`.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtk.comm.dispatch import Router
from dtk.comm.seam import Seam, broken_peer, bus_factor

BACKEND_NAME = "dtk"
log = logging.getLogger(__name__)

WAIT_SLICE = datetime.timedelta(milliseconds=50)
"""A blocked wait wakes this often to see whether the seam released it (a peer's death can leave gloo blocked)."""


class SeamWork(dist._Work):
    """The inner work, waited on directly by the caller's thread; it completes when the inner work does or when the
    seam releases it, and never raises. A future (DDP asks for one) is made only when asked for."""

    def __init__(self, group: "DtkGroup", kind: str, result, inner, *, p2p: bool = False):
        super().__init__()
        self._group, self._kind, self._result, self._inner = group, kind, result, inner
        self._t0 = time.perf_counter()
        self._generation = Seam.generation
        self._future: torch.futures.Future | None = None
        self._done = inner is None
        self._completed = threading.Event()  # set by _finish: what a caller sleeps on while another thread waits
        self._p2p = p2p
        self._watched = False
        self._whole: bool | None = None
        if self._done:
            self._completed.set()
        else:
            group.outstanding.add(self)

    def _failed(self, e: Exception) -> None:
        # a peer died or the group was aborted: flag it, never raise into the strategy
        Seam.release(f"{self._kind} failed on rank {self._group.rank()}: {str(e).splitlines()[0][:200]}",
                     generation=self._generation, peer=broken_peer(str(e)))

    def _on_inner_done(self, fut) -> None:
        try:
            fut.wait()
        except Exception as e:
            self._failed(e)
        self._finish()

    def _cut(self) -> None:
        """Complete it without its result: its generation failed."""
        if not self._done:
            Seam.cut += 1
        self._finish()

    def _finish(self) -> None:
        with _finish_lock:
            if self._done:
                return
            self._done = True
            future = self._future  # one made after this point is completed by get_future itself
            self._group.outstanding.discard(self)
        self._completed.set()
        if self._kind:
            Seam.stats.finished(self._kind, time.perf_counter() - self._t0)
        if future is not None:
            future.set_result(self._result)  # outside the lock: it runs the strategy's callbacks

    def wait(self, timeout=None) -> bool:
        if self._done:
            return True
        if self._waited_whole():
            # The group's waiter thread blocks on the inner work and sets the event; this thread sleeps on the
            # event, waking each slice only to see whether the seam released it (a peer's death).
            self._watch()
            while not self._completed.wait(WAIT_SLICE.total_seconds()):
                if Seam.failed_generation >= self._generation:
                    self._cut()
                    break
            return True
        return self._block()

    def _waited_whole(self) -> bool:
        """Works that cannot be waited in slices: gloo's future-less works (its list reduce_scatter) block in wait()
        whatever its timeout, and gloo's send/recv end with an error at their first timed-out wait."""
        if self._whole is None:
            self._whole = self._p2p or not _has_future(self._inner)
        return self._whole

    def _watch(self) -> None:
        with _finish_lock:
            watched, self._watched = self._watched, True
        if not watched:
            self._group.waiter.watch(self)

    def _wait_whole(self) -> None:
        """On the waiter thread: one wait with no timeout (the inner group's own timeout still bounds it)."""
        if self._done:
            return
        try:
            self._inner.wait()
        except Exception as e:  # noqa: BLE001 -- whatever the inner backend raises, the strategy must not see it
            self._failed(e)
        self._finish()

    def _block(self) -> bool:
        inner = self._inner
        while not self._done:
            running = not inner.is_completed()
            try:
                inner.wait(WAIT_SLICE)
            except RuntimeError as e:
                # c10d's slice timeout; the op may complete just after it, so its outcome is read on the next turn
                if running and "Operation timed out!" in str(e):
                    if Seam.failed_generation >= self._generation:
                        # its generation failed: a release may have run between this op's issue and its
                        # registration as outstanding, and releases come once per generation
                        self._cut()
                    continue
                self._failed(e)
            except Exception as e:  # noqa: BLE001 -- whatever the inner backend raises, the strategy must not see it
                self._failed(e)
            self._finish()
        return True

    def get_future(self) -> torch.futures.Future:
        with _finish_lock:
            if self._future is not None:
                return self._future
            future: torch.futures.Future = torch.futures.Future()
            self._future = future
            done = self._done
        if done:
            future.set_result(self._result)
            return future
        try:
            inner = self._inner.get_future()
        except RuntimeError:  # some gloo works (e.g. its list reduce_scatter) have no future: wait in a thread
            self._watch()
        else:
            inner.add_done_callback(self._on_inner_done)
        return future

    def is_completed(self) -> bool:
        return self._done or (self._inner.is_completed() and self._finish_now())

    def _finish_now(self) -> bool:
        # completed: its wait returns at once, and reports a failure if there was one
        if self._waited_whole():
            self._wait_whole()
        else:
            self._block()
        return True

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self):
        return None

    def result(self):
        return self._result


_finish_lock = threading.Lock()


class Waiter:
    """Waits, in order and in one thread, on the works that cannot be waited in slices (see
    `SeamWork._waited_whole`), and completes them: their callers sleep on the work's event, not in a poll."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def watch(self, work: SeamWork) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dtk-waiter", daemon=True)
            self._thread.start()
        self._queue.put(work)

    def _loop(self) -> None:
        while True:
            self._queue.get()._wait_whole()


def _has_future(inner) -> bool:
    if isinstance(inner, _ChunkWork):
        return True  # (asking would chain a future for nothing)
    try:
        inner.get_future()
    except (RuntimeError, AttributeError):  # gloo's reduce_scatter work; a work type with no futures at all
        return False
    return True


class _Serial:
    """Works issued one after another (gloo has no coalesced single-tensor variants), waited on as one."""

    def __init__(self, works: list):
        self._works = works

    def wait(self, timeout=None) -> bool:
        for w in self._works:
            if not w.is_completed():
                w.wait() if timeout is None else w.wait(timeout)  # gloo's wait takes no None
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def get_future(self) -> torch.futures.Future:
        return torch.futures.collect_all([w.get_future() for w in self._works])


def _nbytes(tensors) -> int:
    if len(tensors) == 1:
        return tensors[0].nbytes
    return sum(t.nbytes for t in tensors)


class DtkGroup(dist.ProcessGroup):
    """A process group that forwards to an inner gloo (CPU) or NCCL (CUDA) group of the same ranks."""

    def __init__(self, *, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, use_nccl: bool):
        # torch's stub lists only the (store, rank, size) constructor; (rank, size) is the other overload
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._rank = rank
        self._store, self._timeout, self._use_nccl = store, timeout, use_nccl
        self._inner_cpu: dist.ProcessGroupGloo | None = None  # c10d Backends, not ProcessGroups
        self._inner_cuda: dist.ProcessGroupNCCL | None = None
        self._retired: list = []
        self._world = size
        self._name = self._desc = ""
        self.outstanding: set[SeamWork] = set()
        self.router: Router | None = None
        if not Seam.joining:
            self.rebuild(Seam.generation)
        Seam.groups.append(self)

    # -- identity (DeviceMesh and the functional collectives ask for these) --
    def rank(self) -> int:
        return self._rank

    def assume_rank(self, rank: int) -> None:
        """A shadow is built before it knows whose place it takes; on promotion it becomes `rank`. Python callers
        (dist.get_rank, DDP, DeepSpeed, DeviceMesh) ask rank(); the inner group is made with it at the rejoin."""
        if not Seam.joining:
            raise RuntimeError("only a process that has not joined the job yet can take another rank")
        self._rank = rank

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    # -- reconfiguration --
    def rebuild(self, generation: int) -> None:
        """Replace the inner group(s) with new ones on a fresh store prefix. The old ones are kept alive, not
        destroyed: a gloo op blocked on a dead peer may still sit in their threads, and destroying them under
        it can hang."""
        if self._inner_cpu is not None:
            self._retired.append((self._inner_cpu, self._inner_cuda))
            if self._inner_cuda is not None:
                self._inner_cuda.abort()  # NCCL: ncclCommAbort releases kernels blocked on a dead peer
        store = dist.PrefixStore(f"gen{generation}", self._store)
        self._inner_cpu = dist.ProcessGroupGloo(dist.PrefixStore("cpu", store), self.rank(), self.size(), self._timeout)
        self._inner_cuda = None
        self.waiter = Waiter()  # a fresh one: the old one may sit on an op blocked on a dead peer
        self.router = None
        if Seam.comm_mode == "adaptive" and self.size() > 1:  # a new generation starts native and re-plans
            self.router = Router(store=self._store, rank=self.rank(), size=self.size(), timeout=self._timeout,
                                 generation=generation)
        if self._use_nccl:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self._timeout
            self._inner_cuda = dist.ProcessGroupNCCL(dist.PrefixStore("cuda", store), self.rank(), self.size(), opts)

    def release_outstanding(self) -> None:
        for w in list(self.outstanding):
            w._cut()
        if self._inner_cuda is not None:
            self._inner_cuda.abort()

    def _inner(self, tensors):
        if self._inner_cuda is not None and tensors and tensors[0].is_cuda:
            return self._inner_cuda
        return self._inner_cpu

    def _run(self, kind: str, tensors, result, call, *, size_bytes: int | None = None, peer: int | None = None,
             local=None):
        counting = getattr(Seam._counting, "on", True)
        if counting:
            Seam.stats.issued(kind, _nbytes(tensors) if size_bytes is None else size_bytes, self._world, peer)
        inner = self._inner_cpu if self._inner_cuda is None else self._inner(tensors)
        if inner is None or Seam.failed_generation == Seam.generation:
            # Joining (local until reconfigured) or a peer already failed this step: complete at once, as if every
            # peer held what this rank holds. The values are meaningless and are replaced by the state repair.
            if inner is not None:
                Seam.cut += 1
            if local is not None:
                with torch.no_grad():
                    local()
            return SeamWork(self, kind, result, None)
        return SeamWork(self, kind if counting else "", result, call(inner), p2p=peer is not None)

    def _route(self, kind: str, native, **call):
        """The one place where comm.mode adaptive changes what runs: the planner's way for this call (an algorithm
        or a renumbered group), else `native`. Either way the seam's _run completes it and never raises."""
        if self.router is None:
            return native
        return self.router.route(kind, native, **call)

    # -- collectives the C++ side routes to Python --
    def allreduce(self, tensors, opts):
        return self._run("all_reduce", tensors, tensors, self._route(
            "all_reduce", lambda g: g.allreduce(tensors, opts), tensors=tensors, opts=opts, nbytes=_nbytes(tensors)))

    def allreduce_coalesced(self, tensors, opts):
        return self._run("all_reduce", tensors, tensors, self._route(
            "all_reduce", lambda g: g.allreduce_coalesced(tensors, opts), tensors=tensors, opts=opts, coalesced=True,
            nbytes=_nbytes(tensors)))

    def broadcast(self, tensors, opts):
        return self._run("broadcast", tensors, tensors, self._route(
            "broadcast", lambda g: g.broadcast(tensors, opts), tensors=tensors, opts=opts, nbytes=_nbytes(tensors)))

    def reduce(self, tensors, opts):
        return self._run("reduce", tensors, tensors, self._route(
            "reduce", lambda g: g.reduce(tensors, opts), tensors=tensors, opts=opts, nbytes=_nbytes(tensors)))

    def allgather(self, output_lists, inputs, opts):
        size = sum(_nbytes(o) for o in output_lists)
        return self._run("all_gather", inputs, output_lists, self._route(
            "all_gather", lambda g: g.allgather(output_lists, inputs, opts), tensors=inputs,
            outputs=output_lists[0] if len(output_lists) == 1 else None, nbytes=size),
            size_bytes=size, local=lambda: _fill_lists(output_lists, inputs))

    def allgather_coalesced(self, output_lists, inputs, opts):
        # output_lists[r] holds rank r's inputs, one tensor each
        size = sum(_nbytes(o) for o in output_lists)
        return self._run("all_gather", inputs, output_lists, self._route(
            "all_gather", lambda g: g.allgather_coalesced(output_lists, inputs, opts), tensors=inputs,
            output_lists=output_lists, coalesced=True, nbytes=size),
            size_bytes=size, local=lambda: _fill_coalesced(output_lists, inputs))

    def reduce_scatter(self, outputs, input_lists, opts):
        size = sum(_nbytes(i) for i in input_lists)
        return self._run("reduce_scatter", outputs, outputs, self._route(
            "reduce_scatter", lambda g: g.reduce_scatter(outputs, input_lists, opts), tensors=outputs, opts=opts,
            inputs=input_lists[0] if len(input_lists) == 1 else None, nbytes=size), size_bytes=size)

    def all_gather_single(self, output, input, opts=None):
        opts = opts or dist.AllgatherOptions()
        return self._run("all_gather", [input], [output], self._route(
            "all_gather", lambda g: g._allgather_base(output, input, opts), tensors=[input], output=output,
            nbytes=_nbytes([output])), size_bytes=_nbytes([output]), local=lambda: _fill_flat(output, input))

    _allgather_base = all_gather_single

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return self._run("reduce_scatter", [output], [output], self._route(
            "reduce_scatter", lambda g: _reduce_scatter_base(g, output, input, opts), tensors=[output], opts=opts,
            input=input, nbytes=_nbytes([input])), size_bytes=_nbytes([input]))

    _reduce_scatter_base = reduce_scatter_single

    # gloo has no coalesced single-tensor ops: each pair is its own call, routed as the single op would be
    def all_gather_single_coalesced(self, outputs, inputs, opts):
        return self._run("all_gather", inputs, outputs, lambda g: _Serial([self._route(
            "all_gather", lambda g, o=o, i=i: g._allgather_base(o, i, opts), tensors=[i], output=o,
            nbytes=_nbytes([o]))(g) for o, i in zip(outputs, inputs)]),
            size_bytes=_nbytes(outputs), local=lambda: [_fill_flat(o, i) for o, i in zip(outputs, inputs)])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        return self._run("reduce_scatter", outputs, outputs, lambda g: _Serial([self._route(
            "reduce_scatter", lambda g, o=o, i=i: _reduce_scatter_base(g, o, i, opts), tensors=[o], opts=opts, input=i,
            nbytes=_nbytes([i]))(g) for o, i in zip(outputs, inputs)]), size_bytes=_nbytes(inputs))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
        return self._run("all_to_all", [input], [output],
                         lambda g: g.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts))

    # the stub's overloads take opts optional (or a timeout); the C++ side calls this with all five arguments
    all_to_all_single = alltoall_base  # type: ignore[assignment]

    def alltoall(self, outputs, inputs, opts):
        return self._run("all_to_all", inputs, outputs, lambda g: g.alltoall(outputs, inputs, opts))

    def gather(self, output_lists, inputs, opts):
        return self._run("gather", inputs, output_lists, lambda g: g.gather(output_lists, inputs, opts))

    def scatter(self, outputs, input_lists, opts):
        return self._run("scatter", outputs, outputs, lambda g: g.scatter(outputs, input_lists, opts))

    def barrier(self, opts=None):
        opts = opts or dist.BarrierOptions()
        return self._run("barrier", [], None, lambda g: g.barrier(opts), size_bytes=0)

    def send(self, tensors, dst, tag):
        return self._run("send", tensors, tensors, lambda g: g.send(tensors, dst, tag), peer=dst)

    def recv(self, tensors, src, tag):
        return self._run("recv", tensors, tensors, lambda g: g.recv(tensors, src, tag), peer=src)


def _reduce_scatter_base(g, output: torch.Tensor, input: torch.Tensor, opts):
    """gloo's reduce-scatter of one flat tensor, as gloo computes it: its all-reduce of the input (on a copy), then
    this rank's chunk, bit for bit the same (checked for SUM and AVG, fp32 and bf16, 2 and 3 ranks, odd sizes). But
    gloo's own _reduce_scatter_base gives a work with no future whose wait() ignores its timeout, so the seam had to
    wait it on a waiter thread (two thread wake-ups per call, ~4 % of an FSDP2 step on 2 shared cores); its
    all-reduce is waited in slices by the caller's thread, like every other collective. NCCL keeps its own."""
    if input.is_cuda:
        return g._reduce_scatter_base(output, input, opts)
    buf = input.detach().clone()
    ar = dist.AllreduceOptions()
    ar.reduceOp = opts.reduceOp
    sink = Seam.reduced if Seam.counting() else None  # strategy traffic only: not parity's own reduce-scatters
    return _ChunkWork(g.allreduce([buf], ar), output, buf.view(g.size(), -1)[g.rank()],
                      keep=None if sink is None else lambda: sink.add(buf, output))


class _ChunkWork:
    """An all-reduce's work that, once complete, copies this rank's chunk of the sum into the reduce-scatter's
    output (exactly once, whichever of wait() or the future sees the completion first)."""

    def __init__(self, work, output: torch.Tensor, chunk: torch.Tensor, *, keep=None):
        self._work, self._output, self._chunk, self._keep = work, output, chunk, keep
        self._lock = threading.Lock()
        self._copied = False

    def _copy(self) -> None:
        with self._lock:
            if not self._copied:
                self._output.copy_(self._chunk)
                self._copied = True
                if self._keep is not None:  # resilience.roll_forward: the other ranks' chunks, while they are here
                    self._keep()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._work.wait() if timeout is None else self._work.wait(timeout)  # a slice's timeout raises, as gloo's
        self._copy()
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def get_future(self) -> torch.futures.Future:
        def copied(fut):
            fut.wait()  # raises the all-reduce's error
            self._copy()
        return self._work.get_future().then(copied)


def _fill_lists(output_lists, inputs) -> None:
    for outs, inp in zip(output_lists, inputs):
        for o in outs:
            o.copy_(inp)


def _fill_coalesced(output_lists, inputs) -> None:
    for outs in output_lists:
        for o, inp in zip(outs, inputs):
            o.copy_(inp)


def _fill_flat(output: torch.Tensor, input: torch.Tensor) -> None:
    # FSDP2 gathers in place: its input is this rank's slice of the output, so copy it out first
    output.view(-1, input.numel()).copy_(input.reshape(1, -1).clone())


def _create(dist_opts, backend_opts) -> DtkGroup:
    return DtkGroup(store=dist_opts.store, rank=dist_opts.group_rank, size=dist_opts.group_size,
                    timeout=dist_opts.timeout, use_nccl=_Registered.use_nccl)


class _Registered:
    done = False
    use_nccl = False


def register(*, use_nccl: bool = False, comm_mode: str = "native") -> None:
    """Make `dist.init_process_group("dtk")` and `new_group(backend="dtk")` create DtkGroups."""
    _Registered.use_nccl = use_nccl
    Seam.comm_mode = comm_mode
    if not _Registered.done:
        devices = ["cpu", "cuda"] if use_nccl else ["cpu"]
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=devices)
        _Registered.done = True
