"""The planner's model checked against what it delivers: after a plan change, the next calls of each changed kind
are timed under the new plan and set against the model's prediction and against the old plan's calls just before.

A change promised a gain: the model's time of the old plan minus that of the new one, at the sizes the new plan's
calls had. It delivered the old plan's measured time (its calls in the step before the change, or the model's time
where that step had none worth timing) minus the new plan's. A plan that delivers less than DELIVERED of what it
promised is undone. The times differ per rank, so every rank's figures are merged by one MAX all-reduce (a call
ends with its slowest rank) at the same boundary, and every rank decides on the same numbers."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from dtk.comm.planner import Choice, Links, seconds

CHECK_CALLS = 5
"""Calls under the new plan (each of at least MEASURABLE_BYTES, on every rank) before its check: a median of this
many is not moved by one stalled call on a loaded machine."""
DELIVERED = 0.5
"""A plan that delivers less than this fraction of its promised gain is undone."""
FIGURES = 5
"""Per kind, what the ranks agree on: -calls (so the MAX is minus the fewest calls any rank timed), and medians
per call of the new plan's measured and the old plan's measured seconds (-1: none), the new and the old plan's
predicted seconds."""


@dataclass
class PlanCheck:
    """A plan change waiting for its check."""

    kind: str
    old: Choice
    new: Choice
    links: Links
    """The evidence the change was decided on: the model predicts both plans from it."""
    step: int | None
    before: list[tuple[int, float]]
    """(bytes, seconds) of the old plan's calls in the step before the change."""
    after: list[tuple[int, float]] = field(default_factory=list)
    """(bytes, seconds) of the new plan's calls so far."""

    def figures(self) -> list[float]:
        """This rank's FIGURES, to be merged with every rank's by an element-wise MAX."""
        if not self.after:
            return [0.0, -1.0, -1.0, -1.0, -1.0]
        sizes = [b for b, _ in self.after]
        return [-float(len(self.after)),
                statistics.median(s for _, s in self.after),
                statistics.median(s for _, s in self.before) if self.before else -1.0,
                statistics.median(seconds(self.links, self.kind, self.new, b) for b in sizes),
                statistics.median(seconds(self.links, self.kind, self.old, b) for b in sizes)]

    def verdict(self, agreed: list[float]) -> dict | None:
        """From the merged figures: None while fewer than CHECK_CALLS calls are timed on some rank; else the check
        event's fields, "verdict" kept, undone, or nothing promised (the model saw no gain at these sizes)."""
        calls, measured, old_measured, predicted, old_predicted = agreed
        if -calls < CHECK_CALLS:
            return None
        old = old_measured if old_measured >= 0 else old_predicted
        promised, delivered = old_predicted - predicted, old - measured
        verdict = "nothing promised" if promised <= 0 else ("undone" if delivered < DELIVERED * promised else "kept")
        return {"kind": self.kind, "plan": self.new.describe(), "before": self.old.describe(),
                "changed_at_step": self.step, "calls": int(-calls), "predicted_s": round(predicted, 6),
                "measured_s": round(measured, 6), "before_predicted_s": round(old_predicted, 6),
                "before_measured_s": round(old_measured, 6) if old_measured >= 0 else None,
                "predicted_gain_s": round(promised, 6), "delivered_gain_s": round(delivered, 6), "verdict": verdict}
