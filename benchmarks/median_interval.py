"""A confidence interval for a median that assumes nothing about the distribution, and the verdict
it allows.

The pairs of a benchmark run are independent draws of one ratio, but this machine's speed drifts by
more than the effect being measured, so their spread is neither small nor normal. The
order-statistic interval needs only independence: for sorted values x(1) <= ... <= x(n), the
interval [x(k), x(n+1-k)] misses the true median only when at least n+1-k draws land on one side of
it, so its coverage is 1 - 2 * P(Binomial(n, 1/2) <= k - 1). Taking the largest k whose coverage
still reaches the level asked for gives the narrowest such interval; with fewer than 6 values even
[min, max] covers a median less than 95% of the time, so there is no interval to give.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple


class MedianInterval(NamedTuple):
    low: float
    high: float
    coverage: (
        float  # the exact probability that [low, high] covers the median, >= the level asked for
    )
    rank: int  # low is the rank-th smallest value, high the rank-th largest


def _coverage(n: int, rank: int) -> float:
    tail = sum(math.comb(n, i) for i in range(rank)) / 2**n
    return 1.0 - 2.0 * tail


def median_interval(values: Sequence[float], level: float = 0.95) -> MedianInterval | None:
    """The narrowest order-statistic interval covering the median of `values`' distribution at
    `level`, or None when there are too few values for any to reach it."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be between 0 and 1 (exclusive), got {level}")
    ordered = sorted(values)
    n = len(ordered)
    if n == 0 or _coverage(n, 1) < level:
        return None
    rank = 1
    while rank + 1 <= (n + 1) // 2 and _coverage(n, rank + 1) >= level:
        rank += 1
    return MedianInterval(ordered[rank - 1], ordered[n - rank], _coverage(n, rank), rank)


def verdict_at_most(interval: MedianInterval | None, point: float, target: float) -> str:
    """PASS when the whole interval is at or under `target`, MISS when all of it is over, "unclear"
    when it straddles the target. Without an interval, the point estimate decides and the
    verdict says so."""
    if interval is None:
        return "PASS (point only)" if point <= target else "MISS (point only)"
    if interval.high <= target:
        return "PASS"
    if interval.low > target:
        return "MISS"
    return "unclear"
