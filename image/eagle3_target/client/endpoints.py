"""Round-robin over a target's endpoints, skipping the ones that recently failed until their cool-down ends.

Kept free of I/O so the balancing and back-off rules are easy to read and test on their own; the client owns
the requests and tells the pool what happened.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class EndpointState:
    url: str
    consecutive_failures: int = 0
    not_before: float = 0.0  # monotonic time before which the endpoint is not tried again


class EndpointPool:
    """Thread-safe endpoint choice with per-endpoint exponential back-off."""

    def __init__(
        self, urls: Iterable[str], backoff_initial_s: float = 0.1, backoff_max_s: float = 5.0
    ) -> None:
        self._lock = threading.Lock()
        self._states: list[EndpointState] = []
        self._next = 0
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.replace(urls)

    @property
    def urls(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(s.url for s in self._states)

    def replace(self, urls: Iterable[str]) -> None:
        """Adopt a new endpoint set (e.g. re-resolved), keeping what is known about the survivors."""
        cleaned = list(dict.fromkeys(u.rstrip("/") for u in urls))
        if not cleaned:
            raise ValueError("a target needs at least one endpoint URL")
        with self._lock:
            known = {s.url: s for s in self._states}
            self._states = [known.get(u) or EndpointState(u) for u in cleaned]
            self._next %= len(self._states)

    def pick(self, now: float | None = None) -> tuple[str, float]:
        """The next endpoint in turn not cooling down, else the one free soonest and how long to wait."""
        now = time.monotonic() if now is None else now
        with self._lock:
            n = len(self._states)
            for offset in range(n):
                state = self._states[(self._next + offset) % n]
                if state.not_before <= now:
                    self._next = (self._next + offset + 1) % n
                    return state.url, 0.0
            soonest = min(self._states, key=lambda s: s.not_before)
            return soonest.url, soonest.not_before - now

    def failed(self, url: str, retry_after_s: float | None = None, now: float | None = None) -> float:
        """Record a failure; the endpoint rests for Retry-After if the server gave one, else the back-off.

        Retry-After is floored at the initial back-off: a "Retry-After: 0" must not make the client spin.
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            state = next((s for s in self._states if s.url == url), None)
            if state is None:
                return 0.0  # Dropped by a refresh meanwhile.
            if retry_after_s is None:
                delay = min(self.backoff_max_s, self.backoff_initial_s * 2**state.consecutive_failures)
            else:
                delay = max(retry_after_s, self.backoff_initial_s)
            state.consecutive_failures += 1
            state.not_before = now + delay
            return delay

    def succeeded(self, url: str) -> None:
        with self._lock:
            for state in self._states:
                if state.url == url:
                    state.consecutive_failures = 0
                    state.not_before = 0.0

    def all_cooling(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        with self._lock:
            return all(s.not_before > now for s in self._states)
