"""The client's session with a target: fail-over, back-off, endpoint refresh, token renewal and the
fingerprint pin, over a transport whose replies speak the server's terms (`transport.Refusal`).

Every supervision request is idempotent (a pure function of the batch and the target's fingerprint), so a
request that fails on one endpoint is simply sent again to another: the caller gets each answer exactly once,
from whichever replica answered, and the pinned fingerprint guarantees all answers come from the same model.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from eagle3_target.client.endpoints import EndpointPool
from eagle3_target.client.errors import FingerprintChanged, RequestRejected, ResolveError, TargetUnavailable
from eagle3_target.client.identity import client_id
from eagle3_target.client.resolve import ResolvedTarget
from eagle3_target.client.transport import Reply, Transport, TransportError
from eagle3_target.protocol import CLIENT_HEADER, TokenFileError, read_token_file

T = TypeVar("T")


class Session:
    """Sends requests until an endpoint answers, across a target's endpoints; thread-safe.

    `refresh(wait_s)` re-reads the endpoints from the resource (None for fixed URLs). `on_fingerprint_change`
    is called when an accepted fingerprint change (`allow_fingerprint_change`) makes cached facts stale.
    `on_not_found(url, reply)` may repair a `not_found` refusal (teach a restarted replica the vocab) and
    return the reply of the request sent again.
    """

    def __init__(
        self,
        urls: Iterable[str],
        *,
        refresh: Callable[[float], ResolvedTarget] | None,
        wait: float,
        token: str | None,
        token_file: Path | None,
        timeout_s: float,
        max_attempts: int | None,
        give_up_after_s: float,
        backoff_initial_s: float,
        backoff_max_s: float,
        allow_fingerprint_change: bool,
        refresh_interval_s: float,
        on_fingerprint_change: Callable[[], None],
    ) -> None:
        self.pool = EndpointPool(urls, backoff_initial_s, backoff_max_s)
        # The endpoints are in-cluster peers, reached directly (never through an ambient proxy).
        self.transport = Transport(
            {CLIENT_HEADER: client_id()}, timeout_s=timeout_s, connect_timeout_s=min(timeout_s, 10.0)
        )
        self.max_attempts = max_attempts
        self.give_up_after_s = give_up_after_s
        self.allow_fingerprint_change = allow_fingerprint_change
        # What happened on the wire: requests, bytes, retries by cause, refreshes (read it, don't write it).
        self.stats: Counter[str] = Counter()
        self._token_file = token_file
        self._token = token
        self._refresh = refresh
        self._wait = wait
        self._refresh_interval_s = refresh_interval_s
        self._on_fingerprint_change = on_fingerprint_change
        self._last_refresh = time.monotonic()
        self._refresh_problem: str | None = None  # why the last refresh found no serving target
        self._refresh_lock = threading.Lock()  # one thread re-reads the resource (and waits), not each
        self._lock = threading.RLock()
        self._fingerprint: str | None = None

    @property
    def fingerprint(self) -> str | None:
        return self._fingerprint

    def close(self) -> None:
        self.transport.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        parse: Callable[[memoryview], T],
        repair: Callable[[str, Reply], Reply | None] | None = None,
        **kwargs: Any,
    ) -> tuple[T, Reply]:
        """Send until an endpoint answers with a body that ``parse`` accepts: fail over on connection errors
        (a body cut short among them), refusals that pass and unparseable bodies, with back-off. A
        ``not_found`` refusal goes to ``repair(url, reply)``, whose reply (if any) stands instead. Returns
        the parsed body and the reply."""
        started = time.monotonic()
        give_up_at = started + self.give_up_after_s
        last_problem, attempts = "no attempt made", 0
        for attempt in range(self.max_attempts) if self.max_attempts is not None else itertools.count():
            give_up_at += self._maybe_refresh(force=attempt > 0 and self.pool.all_cooling())
            url, wait = self.pool.pick()
            if wait > give_up_at - time.monotonic():
                break
            if wait > 0:
                time.sleep(wait)
            self.count("requests")
            attempts += 1
            try:
                reply = self.send(method, url + path, **kwargs)
                refusal = reply.refusal
                if refusal is not None and refusal.kind == "not_found" and repair is not None:
                    reply = repair(url, reply) or reply
            except TransportError as exc:
                self.count("connection_errors")
                last_problem = f"{url}: {type(exc).__name__}: {exc}"
                self.pool.failed(url)
                continue
            refusal = reply.refusal
            if refusal is not None and refusal.retryable:
                self.count(f"status_{refusal.status_code}")
                last_problem = f"{url}: {refusal.kind} {refusal.message}"
                self.pool.failed(url, refusal.retry_after_s)
                continue
            if refusal is not None:
                raise RequestRejected(refusal.status_code, refusal.kind, refusal.message)
            try:
                parsed = parse(reply.body)
            except ValueError as exc:  # WireFormatError and pydantic's ValidationError among them
                self.count("corrupt_responses")
                last_problem = f"{url}: unreadable answer: {exc}"
                self.pool.failed(url)
                continue
            self.pool.succeeded(url)
            self.count("bytes_received", reply.body.nbytes)
            return parsed, reply
        resource = f"; the resource: {self._refresh_problem}" if self._refresh_problem else ""
        raise TargetUnavailable(
            f"{method} {path} failed on every endpoint of {list(self.pool.urls)} after "
            f"{attempts} attempts in {time.monotonic() - started:.1f}s; last: {last_problem}{resource}"
        )

    def send(self, method: str, url: str, **kwargs: Any) -> Reply:
        """One request with the current bearer token; an ``unauthorized`` refusal re-reads the token file,
        and a new token there sends the request once more (a rotated Secret), else the refusal stands."""
        token = self._token
        reply = self.transport.request(method, url, headers=_bearer(token), **kwargs)
        refusal = reply.refusal
        if refusal is not None and refusal.kind == "unauthorized" and self._renew_token(token):
            self.count("token_reloads")
            reply = self.transport.request(method, url, headers=_bearer(self._token), **kwargs)
        return reply

    def check_fingerprint(self, fingerprint: str | None, source: str) -> None:
        """Pin the first fingerprint seen; a different one later is a different target."""
        if fingerprint is None:
            return
        with self._lock:
            if self._fingerprint is None or self._fingerprint == fingerprint:
                self._fingerprint = fingerprint
                return
            if not self.allow_fingerprint_change:
                raise FingerprintChanged(self._fingerprint, fingerprint, source)
            # Accepted change: everything cached about the old target is now wrong.
            self.count("fingerprint_changes")
            self._fingerprint = fingerprint
        self._on_fingerprint_change()

    def count(self, event: str, amount: int = 1) -> None:
        with self._lock:
            self.stats[event] += amount

    def _renew_token(self, sent: str | None) -> bool:
        """Whether the token file now holds a token other than `sent` (then it is the session's token)."""
        if self._token_file is None:
            return False
        with self._lock:
            if self._token != sent:  # another thread renewed it meanwhile
                return True
            try:
                token = read_token_file(self._token_file)
            except TokenFileError:
                return False  # a file between two versions: the refusal stands, the next request reads again
            if token == sent:
                return False
            self._token = token
            return True

    def _maybe_refresh(self, force: bool) -> float:
        """Re-read the endpoints from the resource every refresh interval, or at once when all are failing;
        then a target that does not serve is woken if idle and waited for up to `wait` seconds, as at the
        start. Returns the seconds this waited for a target that serves again (not counted against
        `give_up_after_s`: a wake takes scheduling and a model load)."""
        if self._refresh is None:
            return 0.0
        entered = time.monotonic()
        with self._lock:
            if not (force or entered - self._last_refresh >= self._refresh_interval_s):
                return 0.0
            seen = self._last_refresh  # moves on every refresh: a thread that waited for another's sees it
        with self._refresh_lock:
            with self._lock:
                if self._last_refresh != seen:  # another thread refreshed (and waited) meanwhile
                    return time.monotonic() - entered if self._refresh_problem is None else 0.0
            try:
                target = self._refresh(self._wait if force else 0.0)
            except ResolveError as exc:
                self.count("refresh_failures")
                self._note_refresh(problem=str(exc))
                return 0.0  # Not serving (or the API server is away): keep trying the endpoints we know.
            self._note_refresh(problem=None)
            self.count("refreshes")
            self.check_fingerprint(target.fingerprint, f"{target.namespace}/{target.name} status")
            if target.urls:
                self.pool.replace(target.urls)
        return time.monotonic() - entered

    def _note_refresh(self, problem: str | None) -> None:
        with self._lock:
            self._last_refresh = time.monotonic()
            self._refresh_problem = problem


def _bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}
