"""A rank's line to its launcher, over the run's TCPStore: heartbeats, failure notices, reports and plans.

A watcher thread (its own store connection) polls for the launcher's failure notice of the current generation
and releases the seam's blocked collectives at once, so no rank waits for a collective timeout.
"""
from __future__ import annotations

import datetime
import json
import logging
import threading
import time

import torch.distributed as dist

from dtk.comm.group import Seam

log = logging.getLogger(__name__)
POLL_SECONDS = 0.05


def connect(address: str, *, timeout_s: float = 300) -> dist.Store:
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


class Control:
    def __init__(self, *, address: str, rank: int):
        self.rank = rank
        self.store = dist.PrefixStore("dtk", connect(address))
        self._watch_store = dist.PrefixStore("dtk", connect(address))
        self.step = 0
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="dtk-control", daemon=True).start()

    def _watch(self) -> None:
        last_beat = 0.0
        while not self._stop.wait(POLL_SECONDS):
            try:
                generation = Seam.generation
                key = f"gen{generation}/failure"
                if Seam.failed_generation != generation and self._watch_store.check([key]):
                    Seam.release(self._watch_store.get(key).decode(), generation=generation)
                if time.monotonic() - last_beat > 0.5:
                    self._watch_store.set(f"beat/{self.rank}", json.dumps({"step": self.step, "t": time.time()}))
                    last_beat = time.monotonic()
            except Exception:  # the launcher went away: the run is over, the main thread will find out
                return

    def beat(self, step: int) -> None:
        self.step = step

    def report(self, generation: int, kind: str, payload: dict) -> None:
        """kind: "failed" (this rank saw generation's failure) or "rejoined" (it runs in generation)."""
        self.store.set(f"gen{generation}/{kind}/{self.rank}", json.dumps(payload))

    def wait_plan(self, generation: int) -> dict:
        key = f"gen{generation}/plan"
        self.store.wait([key], datetime.timedelta(seconds=600))
        return json.loads(self.store.get(key))

    def finish(self, step: int) -> None:
        self.store.set(f"done/{self.rank}", str(step))

    def close(self) -> None:
        self._stop.set()
