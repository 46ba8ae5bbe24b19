"""The host prefetch pipeline: order, back-pressure, errors, early stop."""

from __future__ import annotations

import threading
import time

import pytest

from embedpipe.runtime.prefetch import Prefetcher


def test_results_come_back_in_input_order():
    def slow_on_odd(i):
        time.sleep(0.002 * (i % 2))
        return i * i

    with Prefetcher(range(20), slow_on_odd, depth=3) as ready:
        assert list(ready) == [i * i for i in range(20)]


def test_the_producer_stays_at_most_depth_ahead():
    produced, lag = [], []
    consumed = 0

    def prepare(i):
        produced.append(i)
        return i

    with Prefetcher(range(30), prepare, depth=2) as ready:
        for item in ready:
            time.sleep(0.01)  # slow consumer: the producer must wait for it
            lag.append(len(produced) - consumed)
            consumed += 1
    # queue of 2 + the item just taken + one prepared item blocked on put
    assert max(lag) <= 2 + 2 and len(produced) == 30


def test_an_error_is_raised_in_the_consumer_at_its_place():
    def prepare(i):
        if i == 3:
            raise KeyError("bad row group")
        return i

    seen = []
    with pytest.raises(KeyError, match="bad row group"):
        with Prefetcher(range(10), prepare) as ready:
            for item in ready:
                seen.append(item)
    assert seen == [0, 1, 2]


def test_leaving_early_stops_the_thread():
    started = threading.active_count()
    prepared = []
    with Prefetcher(range(10_000), lambda i: prepared.append(i) or i, depth=2) as ready:
        for item in ready:
            if item == 5:
                break
    assert threading.active_count() == started  # joined
    assert len(prepared) < 20


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        Prefetcher([], lambda x: x, depth=0)
