"""How often the parity keeper protects a step boundary: every N steps, or (`auto`) at Young/Daly's interval from the
measured cost of one protection and the mean time between the job's failures."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

DEFAULT_MTBF_S = 1000 * 86_400 / (6.5 * 2048)
"""6,490 s: what a 16,384-GPU job (2,048 nodes of 8) sees at the 6.5 failures per 1,000 node-days that `dtk simulate
productivity` assumes by default. A job this small fails far less often; `resilience.mtbf_s` says how often yours
does."""


@dataclass(kw_only=True)
class ProtectSchedule:
    """Every rank holds one and feeds it the same figures (the max over ranks, gathered in the protection's vote), so
    every rank computes the same interval; a replacement adopts the survivors' one when it joins."""

    every: int | Literal["auto"]
    mtbf_s: float
    interval: int = 1
    """Steps between two protected step boundaries: a failure redoes at most this many steps."""
    cost_s: float = 0.0
    """Seconds one protection took (from its start to its vote), the slowest rank's, the last one measured."""
    step_s: float = 0.0
    optimum_s: float = 0.0
    """Young/Daly: sqrt(2 x cost x MTBF), seconds of training between two protections."""

    def __post_init__(self):
        if self.every != "auto":
            self.interval = int(self.every)

    def observe(self, *, cost_s: float, step_s: float) -> None:
        """One protection completed everywhere, costing `cost_s` on the slowest rank, on steps of `step_s`."""
        if self.every != "auto" or step_s <= 0:
            return  # the protection before the first step has no step time to weigh it against
        self.cost_s, self.step_s = cost_s, step_s
        self.optimum_s = math.sqrt(2.0 * cost_s * self.mtbf_s)
        self.interval = max(1, round(self.optimum_s / step_s))

    def adopt(self, interval: int) -> None:
        """The interval every rank agreed on at a recovery (a survivor may have seen one more vote than another)."""
        if self.every == "auto" and interval >= 1:
            self.interval = interval

    def figures(self) -> dict:
        why = (f"every {self.every} steps, as the recipe asks" if self.every != "auto" else
               f"Young/Daly: sqrt(2 x {self.cost_s:.4f} s per protection x {self.mtbf_s:.0f} s MTBF) = "
               f"{self.optimum_s:.2f} s = {self.interval} steps of {self.step_s:.4f} s")
        return {"protect_every": self.every, "protect_interval": self.interval, "mtbf_s": self.mtbf_s,
                "protect_cost_s": self.cost_s, "young_daly_s": self.optimum_s, "why": why}
