"""Ranges laid end to end: each helper against the same ranges written out in Python."""

import numpy as np

from embedpipe.ranges import bounds, ranges, within

COUNTS = np.array([2, 0, 3, 1], dtype=np.int64)
STARTS = np.array([10, 99, 4, 0], dtype=np.int64)


def test_bounds_start_each_range_where_the_one_before_ends():
    assert bounds(COUNTS).tolist() == [0, 2, 2, 5, 6]
    assert bounds(np.array([], dtype=np.int64)).tolist() == [0]


def test_within_counts_each_range_from_zero():
    assert within(COUNTS).tolist() == [i for n in COUNTS.tolist() for i in range(n)] == [0, 1, 0, 1, 2, 0]


def test_ranges_lay_each_range_end_to_end_and_skip_the_empty_ones():
    expected = [i for s, n in zip(STARTS.tolist(), COUNTS.tolist()) for i in range(s, s + n)]
    assert ranges(STARTS, COUNTS).tolist() == expected == [10, 11, 4, 5, 6, 0]
    assert ranges(STARTS[:0], COUNTS[:0]).dtype == np.int64 and ranges(STARTS[:0], COUNTS[:0]).size == 0
