"""Comm-time accounting: overlapping all-reduce intervals are counted once."""

from rayapp.timing import CommTimer


def test_union_of_overlapping_intervals():
    timer = CommTimer()
    for start, end in [(0.0, 1.0), (0.5, 1.5), (3.0, 4.0), (3.2, 3.4)]:
        timer.record(start, end)
    assert timer.take_total_s() == 2.5
    assert timer.take_total_s() == 0.0  # taking clears


def test_disjoint_intervals_add_up():
    timer = CommTimer()
    timer.record(2.0, 2.25)
    timer.record(0.0, 0.5)
    assert timer.take_total_s() == 0.75
