"""benchmarks/median_interval.py: the order-statistic interval and the three-way verdict it
allows."""

from __future__ import annotations

import math
import random
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from median_interval import median_interval, verdict_at_most  # noqa: E402


def test_six_values_give_min_to_max_at_their_exact_coverage():
    interval = median_interval([1.3, 1.0, 1.2, 0.9, 1.1, 1.4])
    assert (interval.low, interval.high, interval.rank) == (0.9, 1.4, 1)
    assert interval.coverage == pytest.approx(1 - 2 / 64)


def test_five_values_are_too_few_for_95_percent():
    assert median_interval([1.0, 1.1, 1.2, 1.3, 1.4]) is None
    assert median_interval([]) is None
    assert median_interval([1.0, 1.1, 1.2, 1.3, 1.4], level=0.9).coverage == pytest.approx(
        1 - 2 / 32
    )


def test_twenty_values_use_the_sixth_from_each_end():
    values = [float(i) for i in range(1, 21)]
    random.Random(3).shuffle(values)
    interval = median_interval(values)
    assert (interval.low, interval.high, interval.rank) == (6.0, 15.0, 6)
    tail = sum(math.comb(20, i) for i in range(6)) / 2**20
    assert interval.coverage == pytest.approx(1 - 2 * tail)
    # one rank narrower would fall under 95%
    narrower_tail = sum(math.comb(20, i) for i in range(7)) / 2**20
    assert 1 - 2 * narrower_tail < 0.95


def test_coverage_holds_on_a_skewed_distribution():
    # the claim is distribution-free: check it on an exponential, far from normal
    rng = random.Random(11)
    true_median = math.log(2)
    trials, covered = 2000, 0
    for _ in range(trials):
        interval = median_interval([rng.expovariate(1.0) for _ in range(15)])
        covered += interval.low <= true_median <= interval.high
    assert covered / trials >= 0.94


@pytest.mark.parametrize("level", [0.0, 1.0, 1.5])
def test_level_outside_zero_one_is_refused(level):
    with pytest.raises(ValueError, match="level must be between 0 and 1"):
        median_interval([1.0] * 10, level=level)


def test_verdict_passes_misses_or_says_unclear():
    below = median_interval([0.98, 1.0, 1.01, 1.02, 1.03, 1.04])
    above = median_interval([1.06, 1.07, 1.08, 1.09, 1.1, 1.2])
    straddling = median_interval([0.92, 1.01, 1.04, 1.06, 1.1, 1.2])
    assert verdict_at_most(below, 1.015, 1.05) == "PASS"
    assert verdict_at_most(above, 1.085, 1.05) == "MISS"
    assert verdict_at_most(straddling, 1.05, 1.05) == "unclear"
    assert verdict_at_most(None, 1.04, 1.05) == "PASS (point only)"
    assert verdict_at_most(None, 1.06, 1.05) == "MISS (point only)"
