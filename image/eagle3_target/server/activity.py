"""Who pulls from this server, and when last: the data requests (supervision, NeMo's /generate, weights) by
client, so the operator can tell a target nobody trains against from one in use.

Clients of ours name their process in CLIENT_HEADER; a request without it is counted under its peer host
(NeMo's client sends none; behind one host several NeMo processes read as one consumer). At most
MAX_CLIENTS are remembered (the least recent go first) and the /readyz answer lists MAX_LISTED of them, so
neither memory nor the probe's answer grows with the number of clients ever seen. Times are taken on the
monotonic clock and reported as ages (protocol.Activity), so a wall clock set back or skewed between nodes
cannot make a request look older than it is.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping

from eagle3_target.protocol import CLIENT_HEADER, CONSUMER_WINDOW_SECONDS, Activity, ClientActivity

MAX_CLIENTS = 1024
MAX_LISTED = 32
# A client id longer than this is cut: the header is the client's to write.
MAX_ID_LENGTH = 200


class ActivityLog:
    def __init__(self) -> None:
        self._clients: OrderedDict[str, tuple[int, float]] = OrderedDict()  # id -> (requests, last), LRU
        self._requests = 0
        self._in_flight = 0
        self._last: float | None = None
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def request(self, client: str) -> Iterator[None]:
        """One data request of `client`, counted when it starts; in flight until it ends, and the end is
        the last activity too (a long request keeps its target from looking idle)."""
        now = time.monotonic()
        with self._lock:
            requests, _ = self._clients.pop(client, (0, now))
            self._clients[client] = (requests + 1, now)
            while len(self._clients) > MAX_CLIENTS:
                self._clients.popitem(last=False)
            self._requests += 1
            self._in_flight += 1
            self._last = now
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1
                self._last = time.monotonic()

    def active(self, window: float = CONSUMER_WINDOW_SECONDS) -> int:
        """Clients with a data request in the last `window` seconds (the active-clients gauge)."""
        with self._lock:
            return self._active(time.monotonic(), window)

    def _active(self, now: float, window: float) -> int:
        """`active` at `now`; the caller holds the lock, so a snapshot's figures are all of one moment."""
        return sum(1 for _, last in self._clients.values() if last >= now - window)

    def snapshot(self, *, identities: bool = True) -> Activity:
        """Counts and ages now; the most recent clients' ids too unless `identities` is False (a caller
        without the token of a target with auth learns how much it is used, not by whom)."""
        with self._lock:
            now = time.monotonic()
            recent = list(itertools.islice(reversed(self._clients.items()), MAX_LISTED)) if identities else []
            return Activity(
                requests=self._requests,
                idle_seconds=None if self._last is None else now - self._last,
                in_flight=self._in_flight,
                active_clients=self._active(now, CONSUMER_WINDOW_SECONDS),
                clients=tuple(
                    ClientActivity(id=client, requests=requests, idle_seconds=now - last)
                    for client, (requests, last) in recent
                ),
            )


def client_of(headers: Mapping[str, str], peer_host: str | None) -> str:
    """The id a request counts under: its CLIENT_HEADER (cut to MAX_ID_LENGTH), else its peer host."""
    named = headers.get(CLIENT_HEADER)
    if named:
        return named[:MAX_ID_LENGTH]
    return f"peer {peer_host or 'unknown'}"
