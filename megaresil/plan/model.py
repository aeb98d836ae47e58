"""Closed-form checkpoint intervals and expected goodput.

Failures arrive at rate 1/M (M: the job's mean time between failures). A save
stops the step loop for `blocking` seconds and is durable `total` seconds
after it starts; a failure costs its restart downtime R plus the work since
the newest durable save. Per unit of wall time (first order in 1/M):

    goodput(tau) = tau / (tau + b) * (1 - (R + (tau + b) / 2 + lag) / M)

where lag = total - blocking for an asynchronous save (the newest save is not
yet durable for that long) and 0 for a synchronous one (b = total). A failure
that a live replacement recovers resumes at the step reached: only the share
`rollback` of the failures pays the (tau + b) / 2 + lag.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young (1974): tau = sqrt(2 C M)."""
    return math.sqrt(2 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly (2006), the higher-order optimum of compute time between saves."""
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    x = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - cost_s


def daly_goodput(tau_s: float, cost_s: float, restart_s: float, mtbf_s: float) -> float:
    """Daly's expected solve/wall ratio, failures striking restarts too:
    tau / (M e^(R/M) (e^((tau + C)/M) - 1))."""
    m = mtbf_s
    return tau_s / (m * math.exp(restart_s / m) * math.expm1((tau_s + cost_s) / m))


@dataclass
class Policy:
    name: str
    blocking_s: float  # seconds the loop stops per save
    total_s: float  # seconds from a save's start until it is durable
    restart_s: float  # mean downtime per failure (the mix of recovery paths)
    extra_blocking_per_s: float = 0.0  # other saves' stall per second (a slower global tier)
    rollback: float = 1.0  # the share of failures that go back to the newest durable save

    @property
    def lag_s(self) -> float:
        return max(0.0, self.total_s - self.blocking_s)

    def goodput(self, tau_s: float, mtbf_s: float) -> float:
        b = self.blocking_s
        lost = self.restart_s + self.rollback * ((tau_s + b) / 2 + self.lag_s)
        return max(0.0, tau_s / (tau_s + b) * (1 - self.extra_blocking_per_s)
                   * (1 - lost / mtbf_s))

    def best_interval(self, mtbf_s: float, step_s: float) -> float:
        """The compute seconds between saves that maximise goodput: a whole
        number of steps, never less than one, and never less than a save's
        total time (an async save cannot start before the last one is durable).
        Goodput is unimodal in tau, so in log tau too: a golden-section search
        over log tau (a fixed number of halvings of a range of any width
        finds the optimum of a 1e9-hour MTBF too), then the better whole
        step count beside it."""
        floor = max(step_s, self.total_s if self.lag_s else 0.0)
        lo, hi = math.log(floor), math.log(max(floor, 4 * mtbf_s))
        ratio = (math.sqrt(5) - 1) / 2
        for _ in range(100):
            a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
            if self.goodput(math.exp(a), mtbf_s) >= self.goodput(math.exp(b), mtbf_s):
                hi = b
            else:
                lo = a
        lo = math.exp(lo)
        least = math.ceil(floor / step_s - 1e-9)
        steps = [max(least, math.floor(lo / step_s)), max(least, math.ceil(lo / step_s))]
        return max(steps, key=lambda n: self.goodput(n * step_s, mtbf_s)) * step_s
