"""prefetch(): results in submission order, bounded look-ahead, errors at their own position."""

from __future__ import annotations

import random
import threading
import time

import pytest
from eagle3_target.client import prefetch


def test_results_come_in_submission_order_with_at_most_depth_in_flight():
    in_flight, peak, lock = 0, 0, threading.Lock()
    jitter = random.Random(0)

    def slow_square(x: int) -> int:
        nonlocal in_flight, peak
        with lock:
            in_flight += 1
            peak = max(peak, in_flight)
        time.sleep(jitter.random() * 0.01)  # later items often finish first
        with lock:
            in_flight -= 1
        return x * x

    assert list(prefetch(slow_square, range(40), depth=3)) == [x * x for x in range(40)]
    assert 1 <= peak <= 3


def test_an_error_surfaces_at_its_position_and_stops_the_iteration():
    def fail_on_five(x: int) -> int:
        if x == 5:
            raise RuntimeError("batch 5 failed")
        return x

    got: list[int] = []
    with pytest.raises(RuntimeError, match="batch 5"):
        for x in prefetch(fail_on_five, range(10), depth=4):
            got.append(x)
    assert got == [0, 1, 2, 3, 4]


def test_the_input_is_consumed_lazily():
    pulled: list[int] = []

    def source():
        for i in range(100):
            pulled.append(i)
            yield i

    results = prefetch(lambda x: x, source(), depth=2)
    assert next(results) == 0
    assert len(pulled) <= 3  # depth ahead of what was consumed, not the whole input
    results.close()


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="depth"):
        list(prefetch(lambda x: x, [1], depth=0))
