"""The walk of scripts/bench/long_context.py: which sequence lengths to try, in which order, and what ends
it. Decisions only (no torch, no processes): the caller passes how to try a length and how long a step at
a length is predicted to take, so the rules are tested without a GPU.

Upward: from ``start``, each next length is ``growth`` times the last one that trained, rounded down to a
multiple of ``multiple`` (at least one multiple more), until a length fails or ``max`` has trained. A next
length past ``max`` is ``max`` itself: the bound a command names is tried, not stepped over.
Then bisection between the longest that trained and the shortest that failed, until they are within
``resolution`` of the former. A growth of 2 doubles; a growth of 1.05 started just below an estimate
brackets it in two or three tries, which is what a GPU command of a few minutes affords when every try
builds a billion-parameter model.

The time limit: a length whose predicted step time exceeds ``time_limit`` seconds is not tried, and the
walk ends there (``stopped_by`` "time", ``would_try`` that length), so a command with a wall-clock limit
is never killed in the middle of a step that cannot finish. The first length has no prediction (nothing
was measured yet) and is always tried.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WalkPlan:
    """The walk's bounds (long_context.py's flags of the same names)."""

    start: int
    max: int
    multiple: int = 1024
    resolution: float = 0.05
    growth: float = 2.0
    time_limit: float | None = None  # seconds a step may be predicted to take; None: no limit

    def __post_init__(self) -> None:
        if self.growth <= 1.0:
            raise ValueError(f"growth must be above 1, got {self.growth}")
        if self.start < 1 or self.multiple < 1:
            raise ValueError(f"start and multiple must be positive, got {self.start} and {self.multiple}")


@dataclass
class WalkResult:
    """How a walk ended."""

    longest: int = 0  # the longest length that trained; 0 when none did
    shortest_failed: int | None = None
    stopped_by: str = "max"  # "max": max trained; "failed"; "time": the time limit
    would_try: int | None = None  # with "time": the length the limit kept out
    tried: list[int] = field(default_factory=list)


def next_length(seq: int, growth: float, multiple: int) -> int:
    """The length after `seq` on the way up: `growth` x `seq` rounded down to a multiple, at least one
    multiple more (rounding down keeps a growth of 1 + r within a bisection's resolution r)."""
    return max(seq + multiple, int(seq * growth) // multiple * multiple)


def too_slow(predicted_s: float | None, time_limit: float | None) -> bool:
    """Whether a length predicted to take `predicted_s` a step stays untried under `time_limit`."""
    return time_limit is not None and predicted_s is not None and predicted_s > time_limit


def walk_lengths(
    plan: WalkPlan, attempt: Callable[[int], bool], predict_s: Callable[[int], float | None]
) -> WalkResult:
    """Run the walk: `attempt(seq)` trains one length and says whether it did; `predict_s(seq)` is the
    predicted step time at `seq` from what was measured so far (None before any measurement)."""
    result = WalkResult()

    def allowed(seq: int) -> bool:
        if too_slow(predict_s(seq), plan.time_limit):
            result.stopped_by, result.would_try = "time", seq
            return False
        return True

    def tries(seq: int) -> bool:
        result.tried.append(seq)
        return attempt(seq)

    seq = plan.start
    while True:
        if seq > plan.max:
            break
        if not allowed(seq):
            return result
        if not tries(seq):
            result.shortest_failed, result.stopped_by = seq, "failed"
            break
        result.longest = seq
        if seq >= plan.max:
            break
        seq = min(plan.max, next_length(seq, plan.growth, plan.multiple))
    bad = result.shortest_failed
    while bad is not None and result.longest:
        good = result.longest
        if bad - good <= max(plan.multiple, int(plan.resolution * good)):
            break
        mid = (good + bad) // 2 // plan.multiple * plan.multiple
        if mid in (good, bad):
            break
        if not allowed(mid):
            return result
        if tries(mid):
            result.longest = mid
        else:
            result.shortest_failed = bad = mid
    return result
