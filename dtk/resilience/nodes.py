"""In-place recovery across nodes: node 0's launcher coordinates every recovery of the run; a launcher on another node
reports its ranks' deaths to node 0 and carries out node 0's replacement requests for its ranks. Both sides talk
through the run's store (node 0's), under `dtk/run/nodes/<node>/`.

Node 0 hands the recovery sequence (dtk.resilience.recovery) a `Coordinator`: the RunView of the whole run.
"""
from __future__ import annotations

import json
import time

REPLACE_TIMEOUT_S = 120.0
"""How long node 0 waits for another node to start a rank's replacement (a cold start takes seconds)."""


def _dead_key(node: int) -> str:
    return f"nodes/{node}/dead"


class NodeReporter:
    """A launcher on node k > 0: publishes which of its ranks are dead (a snapshot, so node 0 never sees a death
    twice once the rank is replaced) and answers node 0's replacement requests in order."""

    def __init__(self, *, run_store, node: int):
        self.store, self.node = run_store, node
        self.next_request = 0
        self._published: str | None = None

    def publish(self, dead: dict[int, dict]) -> None:
        """`dead`: rank -> {"code": exit status, "detected_at": time}; only changes go to the store."""
        text = json.dumps({str(r): v for r, v in sorted(dead.items())})
        if text != self._published:
            self.store.set(_dead_key(self.node), text)
            self._published = text

    def serve(self, replace, dead: dict[int, dict]) -> None:
        """Carry out node 0's requests: `replace(rank, generation) -> dict` (the launcher's own); the new snapshot
        of dead ranks is published before the answer, so node 0 never reads a replaced rank as dead."""
        while self.store.check([f"nodes/{self.node}/replace/{self.next_request}"]):
            seq = self.next_request
            request = json.loads(self.store.get(f"nodes/{self.node}/replace/{seq}"))
            how = replace(request["rank"], request["generation"])
            dead.pop(request["rank"], None)
            self.publish(dead)
            self.store.set(f"nodes/{self.node}/replaced/{seq}", json.dumps(how))
            self.next_request += 1


class Coordinator:
    """Node 0's view of the whole run for the recovery sequence (dtk.resilience.recovery.RunView): every rank of
    every node; a rank of node k is replaced by node k's launcher on request."""

    def __init__(self, *, launcher, run_store, nnodes: int, nproc: int):
        self.launcher, self.store, self.nnodes, self.nproc = launcher, run_store, nnodes, nproc
        self._requests = [0] * nnodes

    # the RunView's fields, the launcher's own
    @property
    def control(self):
        return self.launcher.control

    @property
    def run_dir(self):
        return self.launcher.run_dir

    @property
    def generation(self) -> int:
        return self.launcher.generation

    @generation.setter
    def generation(self, value: int) -> None:
        self.launcher.generation = value

    def node_of(self, rank: int) -> int:
        return rank // self.nproc

    def remote_dead(self) -> dict[int, dict]:
        """The ranks other nodes report dead (and have not replaced yet): rank -> {code, detected_at}."""
        out: dict[int, dict] = {}
        for node in range(1, self.nnodes):
            if self.store.check([_dead_key(node)]):
                out.update({int(r): v for r, v in json.loads(self.store.get(_dead_key(node))).items()})
        return out

    def ranks(self) -> list[int]:
        return list(range(self.nnodes * self.nproc))

    def dead(self) -> list[int]:
        return sorted(set(self.launcher.dead()) | set(self.remote_dead()))

    def replace(self, rank: int, generation: int) -> dict:
        node = self.node_of(rank)
        if node == 0:
            return self.launcher.replace(rank, generation)
        seq = self._requests[node]
        self._requests[node] += 1
        self.store.set(f"nodes/{node}/replace/{seq}", json.dumps({"rank": rank, "generation": generation}))
        answer = f"nodes/{node}/replaced/{seq}"
        deadline = time.monotonic() + REPLACE_TIMEOUT_S
        while not self.store.check([answer]):
            if time.monotonic() > deadline:
                from dtk.resilience.recovery import RecoveryFailed

                raise RecoveryFailed(f"node {node} did not replace rank {rank} in {REPLACE_TIMEOUT_S:.0f}s")
            time.sleep(0.005)
        return {**json.loads(self.store.get(answer)), "node": node}
