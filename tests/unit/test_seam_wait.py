"""How a SeamWork waits on its inner work: in slices, so that a release frees it; a slice's timeout is never taken
for a failure, a real failure is flagged and never raised, and a release completes a wait that gloo would block."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from dtk.comm.group import Seam, SeamWork, Waiter


class InnerWork:
    """Stands in for a gloo work: `outcomes` says what each wait(timeout) does ("timeout", "timeout+done",
    "ok", or an error message); "timeout+done" is the race of an op that completes just after a slice ended."""

    def __init__(self, outcomes):
        self.outcomes, self.completed, self.waits = list(outcomes), False, 0

    def is_completed(self) -> bool:
        return self.completed

    def get_future(self):
        return None  # gloo's works have one (all but its reduce_scatter): the seam waits on them directly

    def wait(self, timeout=None) -> bool:
        self.waits += 1
        outcome = self.outcomes.pop(0) if self.outcomes else "block"
        if outcome == "block":
            time.sleep(timeout.total_seconds())
            raise RuntimeError("Operation timed out!")
        if outcome.startswith("timeout"):
            self.completed = outcome == "timeout+done"
            raise RuntimeError("Operation timed out!")
        self.completed = True
        if outcome != "ok":
            raise RuntimeError(outcome)
        return True


@pytest.fixture
def group():
    g = SimpleNamespace(outstanding=set(), rank=lambda: 0, waiter=Waiter())
    Seam.failure, Seam.failed_generation, Seam.groups = None, -1, []
    yield g
    Seam.failure, Seam.failed_generation, Seam.groups = None, -1, []


def test_an_op_that_completes_just_after_a_slice_is_not_a_failure(group):
    inner = InnerWork(["timeout", "timeout+done", "ok"])
    work = SeamWork(group, "all_reduce", "result", inner)
    assert work.wait() is True and work.result() == "result"
    assert Seam.failure is None and inner.waits == 3 and not group.outstanding


def test_a_failed_op_is_flagged_and_not_raised(group):
    inner = InnerWork(["timeout", "Connection closed by peer [127.0.0.1]:1234"])
    work = SeamWork(group, "all_gather", None, inner)
    assert work.wait() is True
    assert "all_gather failed on rank 0: Connection closed by peer" in Seam.failure
    assert work.get_future().done()


def test_a_release_frees_a_wait_that_would_block(group):
    Seam.groups = [SimpleNamespace(release_outstanding=lambda: [w._finish() for w in list(group.outstanding)])]
    work = SeamWork(group, "reduce_scatter", None, InnerWork([]))
    release = threading.Timer(0.1, Seam.release, args=("rank 1 died",))
    release.start()
    assert work.wait() is True  # without the release it would block for good (pytest's timeout ends it)
    # the wait can end on the flagged failure before the release has gone through the groups: joined here, so that
    # its tail does not release the next test's group
    release.join()
    assert Seam.failure == "rank 1 died" and not group.outstanding


class FuturelessWork:
    """gloo's reduce_scatter work: no future, and a wait() that blocks whatever its timeout."""

    def get_future(self):
        raise RuntimeError("this work has no future")

    def is_completed(self) -> bool:
        return False

    def wait(self, timeout=None) -> bool:
        threading.Event().wait()


def test_a_release_frees_a_wait_on_a_work_that_ignores_its_timeout(group):
    Seam.groups = [SimpleNamespace(release_outstanding=lambda: [w._finish() for w in list(group.outstanding)])]
    work = SeamWork(group, "reduce_scatter", None, FuturelessWork())
    release = threading.Timer(0.1, Seam.release, args=("rank 2 died",))
    release.start()
    assert work.wait() is True  # without the release it would block for good (pytest's timeout ends it)
    # the wait can end on the flagged failure before the release has gone through the groups: joined here, so that
    # its tail does not release the next test's group
    release.join()
    assert Seam.failure == "rank 2 died" and not group.outstanding


class P2PWork:
    """gloo's send/recv work: a wait with a timeout that runs out ends the work with an error (so it must never be
    waited in slices); a wait with no timeout returns when the transfer is done."""

    def __init__(self, seconds: float):
        self.seconds, self.timed_waits = seconds, 0

    def get_future(self):
        return None

    def is_completed(self) -> bool:
        return False

    def wait(self, timeout=None) -> bool:
        if timeout is not None:
            self.timed_waits += 1
            raise RuntimeError("Timed out waiting 50ms for recv operation to complete")
        time.sleep(self.seconds)
        return True


def test_a_transfer_longer_than_a_slice_is_not_a_failure(group):
    inner = P2PWork(seconds=0.2)  # four slices
    work = SeamWork(group, "recv", "result", inner, p2p=True)
    assert work.wait() is True and work.result() == "result"
    assert Seam.failure is None and inner.timed_waits == 0 and not group.outstanding
    assert work.get_future().done()
