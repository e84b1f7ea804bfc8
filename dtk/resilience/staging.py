"""The live state as one flat byte string, read into the parity keeper's host staging buffer: on CPU in place, from
CUDA by asynchronous device-to-host copies into pinned memory on a side stream, the XOR then on host cores."""
from __future__ import annotations

import torch

PINNED_PIECE = 16 << 20
"""Bytes per device-to-host copy: two pinned buffers of this size, one filling while the host XORs the other."""


class FlatState:
    """A list of live tensors seen as one flat byte string (each tensor's bytes through a uint8 view). Build it on the
    thread that ran the last update: on CUDA it records an event on that thread's stream, and every read waits for
    it on a side stream, so the copies never race the update and never hold up the next forward."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.views = []
        for i, t in enumerate(tensors):
            if not t.is_contiguous():
                raise ValueError(f"state tensor {i} is not contiguous; its bytes cannot be written back in place")
            self.views.append(t.detach().reshape(-1).view(torch.uint8))
        self.nbytes = sum(v.numel() for v in self.views)
        self.device = next((v.device for v in self.views if v.is_cuda), None)
        self._ready = None
        if self.device is not None:  # unmeasured: no GPU was lent while this was written (BENCHMARKS.md)
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(self.device))
            self._stream = torch.cuda.Stream(self.device, priority=0)  # the lowest priority there is
            self._bounce = [torch.empty(PINNED_PIECE, dtype=torch.uint8, pin_memory=True) for _ in range(2)]

    def xor_into(self, dst: torch.Tensor, start: int) -> None:
        """dst ^= flat bytes [start, start + len(dst)) (bytes past the end of the state count as zeros)."""
        self._read(dst, start, lambda part, src: part.bitwise_xor_(src))

    def copy_into(self, dst: torch.Tensor, start: int) -> None:
        """dst <- flat bytes [start, start + len(dst)) (bytes of dst past the end of the state are left alone)."""
        self._read(dst, start, lambda part, src: part.copy_(src))

    def write_from(self, src: torch.Tensor, start: int) -> None:
        """Flat bytes [start, start + len(src)) <- src (bytes past the end of the state are ignored). A rollback or
        a rebuild: nothing else runs, so a plain copy (synchronous on CUDA) is right."""
        with torch.no_grad():
            self._walk(src, start, lambda view, part: view.copy_(part))

    def _read(self, dst: torch.Tensor, start: int, op) -> None:
        if self.device is None:
            self._walk(dst, start, lambda view, part: op(part, view))
            return
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._walk(dst, start, lambda view, part: pieces.extend(
            (view[i:i + PINNED_PIECE], part[i:i + PINNED_PIECE]) for i in range(0, view.numel(), PINNED_PIECE)))
        events: list = [None, None]
        assert self._ready is not None  # set with the device
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._ready)
            for n, (view, part) in enumerate(pieces + [(None, None)]):
                if view is not None:  # start the copy of piece n while the host works on piece n - 1
                    buf = self._bounce[n % 2]
                    buf[:view.numel()].copy_(view, non_blocking=True)
                    events[n % 2] = torch.cuda.Event()
                    events[n % 2].record(self._stream)
                if n:
                    prev_view, prev_part = pieces[n - 1]
                    events[(n - 1) % 2].synchronize()
                    op(prev_part, self._bounce[(n - 1) % 2][:prev_view.numel()])
                    # the buffer of piece n - 1 is free again once the host is done with it: piece n + 1 may reuse it

    def _walk(self, buf: torch.Tensor, start: int, op) -> None:
        stop, offset = start + buf.numel(), 0
        for v in self.views:
            lo, hi = max(start, offset), min(stop, offset + v.numel())
            if lo < hi:
                op(v[lo - offset:hi - offset], buf[lo - start:hi - start])
            offset += v.numel()
