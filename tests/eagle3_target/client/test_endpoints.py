"""EndpointPool: round-robin over endpoints that are not cooling down after a failure."""

from __future__ import annotations

import pytest
from eagle3_target.client.endpoints import EndpointPool

A, B, C = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"


def test_round_robin_in_order():
    pool = EndpointPool([A, B, C])
    assert [pool.pick(now=0)[0] for _ in range(6)] == [A, B, C, A, B, C]


def test_failed_endpoint_is_skipped_with_exponential_backoff():
    pool = EndpointPool([A, B], backoff_initial_s=1.0, backoff_max_s=3.0)
    assert pool.failed(A, now=0) == 1.0
    assert [pool.pick(now=0.5)[0] for _ in range(3)] == [B, B, B]
    assert pool.failed(A, now=1) == 2.0
    assert pool.failed(A, now=3) == 3.0  # capped
    assert [pool.pick(now=6.5) for _ in range(2)] == [(A, 0.0), (B, 0.0)]  # A rested long enough
    pool.succeeded(A)
    assert pool.failed(A, now=7) == 1.0  # a success resets the back-off


def test_retry_after_overrides_backoff_and_all_cooling_reports_the_wait():
    pool = EndpointPool([A, B], backoff_initial_s=0.1)
    pool.failed(A, retry_after_s=5.0, now=0)
    pool.failed(B, now=0)
    assert pool.all_cooling(now=0.05)
    assert pool.pick(now=0.05) == (B, pytest.approx(0.05))
    assert not pool.all_cooling(now=0.2)
    assert pool.failed(A, retry_after_s=0.0, now=1) == 0.1  # "Retry-After: 0" still rests a little


def test_replace_keeps_state_of_surviving_endpoints_and_drops_the_rest():
    pool = EndpointPool([A, B])
    pool.failed(A, retry_after_s=10, now=0)
    pool.replace([C, A + "/"])
    assert pool.urls == (C, A)
    assert [pool.pick(now=1)[0] for _ in range(2)] == [C, C]  # A still rests
    assert pool.failed(B, now=1) == 0.0  # a dropped endpoint is ignored
    with pytest.raises(ValueError, match="at least one endpoint"):
        pool.replace([])
