"""The client's HTTP/1.1 transport: keep-alive connections per endpoint, bodies read from the socket straight
into one buffer, and each answer told in the server's terms (`Refusal`), so the session above it never reads
an HTTP status.

A target ships 1-2 GB/s of supervision per GPU. httpx (through h11) hands a body over in 64 KiB pieces, each
copied two or three times on its way (into h11's buffer, out of it, into the caller's), which costs a trainer
a CPU core at those rates; the standard library's `http.client` reads a body with ``readinto``, from the
kernel into the caller's buffer, so a body costs the one copy the kernel makes. What httpx would add here
(HTTP/2, proxies, cookies) the client does not use: its endpoints are in-cluster peers, reached directly.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import queue
import threading
import time
import urllib.parse
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

# Idle keep-alive connections kept per endpoint: enough for `prefetch` threads and a few concurrent callers.
MAX_IDLE_PER_ENDPOINT = 8


class TransportError(Exception):
    """No complete answer came back (refused, reset, timed out, or a body cut short): try again elsewhere."""


# The statuses of refusals that pass (a full queue, a loading model, memory or connections in use).
RETRYABLE_STATUS = (429, 503)


@dataclass(frozen=True)
class Refusal:
    """Why an endpoint did not answer, as the server said it (its ``refusals.Refused``): the kind clients
    branch on, its message, whether it passes (and when to come back), and the HTTP status it came with."""

    kind: str
    message: str
    retryable: bool
    retry_after_s: float | None
    status_code: int


@dataclass(frozen=True)
class Reply:
    """One endpoint's whole answer: the body in one buffer, headers (names in lower case), and the
    `Refusal` when it is an error."""

    url: str
    headers: Mapping[str, str]
    body: memoryview
    refusal: Refusal | None


class BodyBuffers:
    """Large body buffers, each reused once nothing views it any more.

    A fresh buffer costs a page fault per page on its first fill, which here makes reading a large body
    several times slower than filling a warm buffer. A body is handed out as a numpy view of a pooled array;
    the tensors decoded from it keep that view alive, and when the last of them is gone the array returns
    to the pool (at most `keep` idle arrays stay, the rest are freed at the next `take`).

    The last view may die in the cyclic GC, which runs wherever Python allocates, `take` included, on the
    thread that holds the pool's lock: so an array comes back through a queue that is safe to put into from
    there (`SimpleQueue.put` takes no lock a thread could already hold), and `take` files what came back.
    """

    def __init__(self, keep: int = 2, min_bytes: int = 1 << 20) -> None:
        self.keep = keep
        self.min_bytes = min_bytes
        self._idle: list[np.ndarray] = []
        self._returned: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        self._lock = threading.Lock()

    def take(self, size: int) -> memoryview:
        """A writable buffer of exactly `size` bytes, its contents undefined."""
        if size < self.min_bytes:
            return memoryview(bytearray(size))
        with self._lock:
            self._file_returned()
            # By position, never `list.remove`: arrays compare element-wise, not by identity.
            fits = [i for i, idle in enumerate(self._idle) if size <= idle.size <= 2 * size]
            array = self._idle.pop(min(fits, key=lambda i: self._idle[i].size)) if fits else None
        if array is None:
            # numpy asks for transparent huge pages for large arrays: a fresh one faults per 2 MiB.
            array = np.empty(size, dtype=np.uint8)
        view = array[:size]
        weakref.finalize(view, self._returned.put, array)
        return view.data

    def _file_returned(self) -> None:
        """Move the arrays given back since the last `take` to the idle ones, keeping the `keep` largest."""
        while True:
            try:
                self._idle.append(self._returned.get_nowait())
            except queue.Empty:
                break
        self._idle.sort(key=lambda idle: idle.size, reverse=True)
        del self._idle[self.keep :]


def read_body(response: http.client.HTTPResponse, buffers: BodyBuffers) -> memoryview:
    """The body in one writable buffer of exactly its Content-Length, filled by ``readinto``.

    A body shorter than its Content-Length is a `TransportError`; one without a length (chunked) is read
    whole.
    """
    declared = response.getheader("content-length")
    if declared is None:
        return memoryview(bytearray(response.read()))
    size = int(declared)
    view = buffers.take(size)
    filled = 0
    while filled < size:
        got = response.readinto(view[filled:])
        if not got:
            raise TransportError(f"body ended after {filled} of its {size} bytes")
        filled += got
    return view


class Transport:
    """Thread-safe: each request takes an idle connection to its endpoint (or opens one) and gives it back."""

    def __init__(self, headers: Mapping[str, str], timeout_s: float, connect_timeout_s: float) -> None:
        self.headers = dict(headers)
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.buffers = BodyBuffers()
        self._idle: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def request(
        self,
        method: str,
        url: str,
        *,
        params: Mapping[str, str] | None = None,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Reply:
        """Send one request (with `headers` besides the transport's own) and read its whole answer;
        `TransportError` when no complete answer came.

        A keep-alive connection the server closed while it sat idle fails before any answer byte, with a
        reset, a broken pipe or an end of stream: then the request goes once more on a fresh connection, as
        any HTTP client does. Anything else (a timeout above all: the server may be computing the answer) is
        a `TransportError` at once, never the same request sent a second time behind the caller's back.
        """
        parts = urllib.parse.urlsplit(url)
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        target = (parts.path or "/") + query
        key = (parts.scheme, parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80))
        typed = {"content-type": "application/octet-stream"} if content is not None else {}
        sent = {**self.headers, **(headers or {}), **typed}
        connection = self._take(key)
        while True:
            reused = connection is not None
            connection = connection or self._open(key)
            try:
                connection.request(method, target, body=content, headers=sent)
                response = connection.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                connection.close()
                # RemoteDisconnected (no status line at all) is a ConnectionResetError.
                if reused and isinstance(exc, ConnectionError):
                    connection = None  # a stale keep-alive connection: once more on a fresh one
                    continue
                raise TransportError(f"{type(exc).__name__}: {exc}") from exc
            try:
                body = read_body(response, self.buffers)
            except (OSError, http.client.HTTPException, TransportError) as exc:
                connection.close()
                raise TransportError(f"{type(exc).__name__}: {exc}") from exc
            if response.will_close:
                connection.close()
            else:
                self._give(key, connection)
            headers_seen = {name.lower(): value for name, value in response.getheaders()}
            return Reply(url + query, headers_seen, body, refusal_of(response.status, headers_seen, body))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle = [connection for pool in self._idle.values() for connection in pool]
            self._idle.clear()
        for connection in idle:
            connection.close()

    def _open(self, key: tuple[str, str, int]) -> http.client.HTTPConnection:
        scheme, host, port = key
        kind: Any = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        connection: http.client.HTTPConnection = kind(host, port, timeout=self.connect_timeout_s)
        try:
            connection.connect()
        except OSError as exc:
            connection.close()
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc
        assert connection.sock is not None  # connect() made it
        connection.sock.settimeout(self.timeout_s)
        return connection

    def _take(self, key: tuple[str, str, int]) -> http.client.HTTPConnection | None:
        with self._lock:
            pool = self._idle.get(key)
            return pool.pop() if pool else None

    def _give(self, key: tuple[str, str, int], connection: http.client.HTTPConnection) -> None:
        with self._lock:
            pool = self._idle.setdefault(key, [])
            if not self._closed and len(pool) < MAX_IDLE_PER_ENDPOINT:
                pool.append(connection)
                return
        connection.close()


def refusal_of(status: int, headers: Mapping[str, str], body: memoryview) -> Refusal | None:
    """The server's error (``{"error": {"type", "message"}}``) of a non-2xx answer, None for a 2xx one."""
    if status < 400:
        return None
    try:
        error = json.loads(bytes(body))["error"]
        kind, message = str(error["type"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        kind, message = "http_error", bytes(body[:200]).decode("utf-8", "replace")
    retry_after = retry_after_s(headers.get("retry-after"))
    return Refusal(kind, message, status in RETRYABLE_STATUS, retry_after, status)


def retry_after_s(value: str | None) -> float | None:
    """Retry-After as seconds (delta-seconds or an HTTP date), or None when absent or unreadable."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None
