"""Shadow ranks: processes started with the run that import, build and warm up everything they can, then wait on
the store. On a failure the launcher promotes one to the failed rank's number, so recovery cold-starts nothing.

The launcher's side is `ShadowPool` (start, promote, replenish, report); the shadow's side is
`wait_for_promotion`. Keys live under the attempt's prefix: `shadow/<id>/ready` and `shadow/<id>/promote`.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable

import torch.distributed as dist

from dtk.resilience import protocol as keys

log = logging.getLogger(__name__)
WAIT_SLICE_S = 2.0
"""A waiting shadow wakes this often to check that its launcher still lives (the store wait is server-side:
no polling, no CPU while the run trains)."""


def wait_for_promotion(store, *, attempt: int, shadow_id: str, ready: dict) -> dict:
    """Say this shadow is ready, then block until the launcher promotes it: returns {rank, generation}."""
    control = keys.attempt_store(store, attempt)
    control.set(keys.shadow_ready(shadow_id), json.dumps(ready))
    key = keys.shadow_promote(shadow_id)
    launcher = os.getppid()
    while True:
        try:
            control.wait([key], datetime.timedelta(seconds=WAIT_SLICE_S))
            return json.loads(control.get(key))
        except RuntimeError:  # the slice ran out (DistStoreError), or the store is gone with the launcher
            if os.getppid() != launcher:
                log.warning("the launcher is gone; this shadow leaves")
                os._exit(0)


@dataclass
class Shadow:
    id: int
    proc: subprocess.Popen
    started_at: float
    ready: dict | None = None


@dataclass(kw_only=True)
class ShadowPool:
    """The launcher's shadows for one attempt. `spawn(shadow_id)` starts a shadow process (the launcher's job)."""

    count: int
    spawn: Callable[[int], subprocess.Popen]
    control: dist.Store
    """This attempt's store prefix."""
    shadows: dict[int, Shadow] = field(default_factory=dict)
    promotions: list[dict] = field(default_factory=list)
    started: int = 0
    died: int = 0

    def start(self) -> None:
        self.replenish()

    def replenish(self) -> list[int]:
        """Start shadows until `count` are alive; the run never waits for them."""
        self._drop_dead()
        new = []
        while len(self.shadows) < self.count:
            sid = self.started
            self.started += 1
            self.shadows[sid] = Shadow(id=sid, proc=self.spawn(sid), started_at=time.time())
            new.append(sid)
        return new

    def _drop_dead(self) -> None:
        for sid, sh in list(self.shadows.items()):
            if sh.proc.poll() is not None:
                log.warning("shadow %d exited (%s) before it was needed", sid, sh.proc.returncode)
                self.died += 1
                del self.shadows[sid]

    def _refresh(self) -> None:
        for sid, sh in self.shadows.items():
            if sh.ready is None and self.control.check([keys.shadow_ready(sid)]):
                sh.ready = json.loads(self.control.get(keys.shadow_ready(sid)))

    def promote(self, *, rank: int, generation: int) -> Shadow | None:
        """Hand `rank` to a shadow: a ready one first, else one still warming up (it is ahead of a cold start).
        None when no shadow is left."""
        self._drop_dead()
        self._refresh()
        if not self.shadows:
            return None
        sid = min(self.shadows, key=lambda s: (self.shadows[s].ready is None, s))
        sh = self.shadows.pop(sid)
        self.control.set(keys.shadow_promote(sid), json.dumps({"rank": rank, "generation": generation}))
        self.promotions.append({"shadow": sid, "pid": sh.proc.pid, "rank": rank, "generation": generation,
                                "was_ready": sh.ready is not None, "time": time.time()})
        return sh

    def rss_bytes(self) -> list[int]:
        import psutil

        out = []
        for sh in self.shadows.values():
            try:
                out.append(psutil.Process(sh.proc.pid).memory_info().rss)
            except psutil.Error:
                pass
        return out

    def summary(self) -> dict:
        return {"count": self.count, "alive": len(self.shadows), "started": self.started, "died": self.died,
                "promotions": len(self.promotions), "promoted": self.promotions, "rss_bytes": self.rss_bytes()}

    def stop(self) -> None:
        for sh in self.shadows.values():
            if sh.proc.poll() is None:
                sh.proc.kill()
        for sh in self.shadows.values():
            sh.proc.wait()
        self.shadows.clear()
