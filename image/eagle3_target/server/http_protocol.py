"""uvicorn's httptools protocol, hardened against connections that never finish a request.

uvicorn bounds none of this: its keep-alive timer runs only between requests and any byte cancels it, and its
``limit_concurrency`` answers plain text and counts probes like any request. So this subclass adds:

- Deadlines. A request's headers must arrive within ``header_timeout`` of the connection opening (or of the
  first byte after a response), its body within ``body_timeout`` of its headers; else the connection is
  closed, and a route still reading that body sees a disconnect. Time the server itself holds the bytes back
  (reading paused for a pipelined request or a body the app has not consumed yet) is not the client's.
  While an answer waits for the client to read (writing paused by flow control), the client must take some
  of it (acknowledge bytes of the socket's send queue) every ``send_timeout``; else the connection is aborted
  (its unsent bytes dropped), so the response ends at once and frees the answer, and the request stops
  counting as in flight.
- A connection cap. ``max_connections`` connections are served, and ``PROBE_CONNECTIONS`` more that may only
  ask the probe paths, so kubelet and Prometheus are answered when the cap is reached. A connection beyond a
  full pool displaces that pool's longest-idle connection (no request in progress); when none is idle it
  gets a JSON 503 and is closed at once (while its request is still on the wire, so a large one may see a
  reset instead).
- File descriptors for everything else. `raise_fd_limit` and `connection_budget` keep the cap, the probe
  connections and the listen backlog (connections accepted in one burst hold their descriptors until the
  loop's next turn) below the open-file limit less `FD_RESERVE`, so the model load, probes and logs never
  meet EMFILE, and the listener never does either (uvloop closes a listener whose accept fails).
- JSON errors. A request the parser cannot frame (``Content-Length: abc``, a broken request line) gets the
  app's JSON 400 instead of uvicorn's plain text.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import resource
import struct
import termios
from collections import OrderedDict
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from uvicorn._types import ASGI3Application, ASGIReceiveCallable, ASGISendCallable, Scope
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from eagle3_target.server.errors import http_status, refusal_response
from eagle3_target.server.metrics import ServerMetrics
from eagle3_target.server.refusals import Malformed, Refused, TooManyConnections
from eagle3_target.server.routes.probes import PROBE_PATHS

log = logging.getLogger(__name__)

# Kubelet's startup, liveness and readiness probes and a Prometheus scrape, with room to spare.
PROBE_CONNECTIONS = 8
# Descriptors kept out of the connection budget: the model load (shards, an engine's sockets and pipes),
# the metrics port, the event loop's own and the logs.
FD_RESERVE = 128
# uvicorn's default listen backlog, the most the budget gives it.
MAX_BACKLOG = 2048
# Checks of a stalled answer's progress per ``send_timeout``: it is aborted at most a quarter late.
SEND_CHECKS_PER_TIMEOUT = 4


def error_bytes(error: Refused, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """`error` as the app would render it, as a complete HTTP/1.1 response that closes the connection: for
    answers the protocol writes itself, before or instead of the app."""
    response = refusal_response(error, {"connection": "close"})
    status = http_status(error)
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}".encode()]
    lines += [name + b": " + value for name, value in [*default_headers, *response.raw_headers]]
    return b"\r\n".join(lines) + b"\r\n\r\n" + response.body


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float
    body_timeout: float
    send_timeout: float
    max_connections: int


@dataclass(frozen=True)
class ConnectionBudget:
    """How many connections and how long a listen backlog fit the open-file limit."""

    max_connections: int
    backlog: int


def unsent_bytes(transport: asyncio.Transport) -> int:
    """What the client has not taken yet: the transport's buffer and the socket's send queue (Linux's
    SIOCOUTQ: bytes the client has not acknowledged), so a client that reads slowly counts as reading."""
    queued = 0
    sock = transport.get_extra_info("socket")
    if sock is not None:
        # termios names SIOCOUTQ TIOCOUTQ: on Linux they are the same ioctl (0x5411).
        with contextlib.suppress(OSError):  # closed meanwhile
            (queued,) = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))
    return transport.get_write_buffer_size() + queued


def raise_fd_limit() -> int:
    """Raise the soft open-file limit to the hard one (containers often start at a soft 1024); the new soft
    limit. (Python reports an unlimited hard limit as -1, which Linux never has for descriptors.)"""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    return soft


def open_fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def connection_budget(requested: int, fd_limit: int, open_fds: int) -> ConnectionBudget:
    """`requested` connections, lowered (with one warning) when they, the probe connections and the backlog
    would not fit in `fd_limit` beside the `open_fds` already open and `FD_RESERVE`. A quarter of what is
    left goes to the backlog, up to uvicorn's default; at least one connection is always served."""
    available = max(fd_limit - open_fds - FD_RESERVE, 0)
    backlog = max(min(MAX_BACKLOG, available // 4), 1)
    allowed = max(available - backlog - PROBE_CONNECTIONS, 1)
    if requested > allowed:
        log.warning(
            "max_connections lowered from %d to %d: the open-file limit is %d, %d are open and %d are kept "
            "for the model load, probes and logs",
            requested,
            allowed,
            fd_limit,
            open_fds,
            FD_RESERVE,
        )
    return ConnectionBudget(min(requested, allowed), backlog)


class ConnectionPool:
    """Connections admitted under one cap; the idle ones (no request in progress) in the order they went
    idle, so a newcomer to a full pool can displace the longest-idle one."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._members: set[HardenedHttpProtocol] = set()
        self._idle: OrderedDict[HardenedHttpProtocol, None] = OrderedDict()

    def admit(self, connection: HardenedHttpProtocol) -> bool:
        """Admit `connection` as idle, closing the longest-idle member if the pool is full; False when the
        pool is full of busy connections."""
        if len(self._members) >= self.capacity:
            if not self._idle:
                return False
            displaced, _ = self._idle.popitem(last=False)
            self._members.discard(displaced)
            displaced.transport.close()
        self._members.add(connection)
        self._idle[connection] = None
        return True

    def idle(self, connection: HardenedHttpProtocol) -> None:
        self._idle[connection] = None
        self._idle.move_to_end(connection)

    def busy(self, connection: HardenedHttpProtocol) -> None:
        self._idle.pop(connection, None)

    def remove(self, connection: HardenedHttpProtocol) -> None:
        self._members.discard(connection)
        self._idle.pop(connection, None)


class ConnectionGuard:
    """One server's limits and its two pools: connections that may ask anything, and probe-only ones."""

    def __init__(self, limits: ConnectionLimits, metrics: ServerMetrics) -> None:
        self.limits = limits
        self.metrics = metrics
        self.serving = ConnectionPool(limits.max_connections)
        self.probes = ConnectionPool(PROBE_CONNECTIONS)

    def admit(self, connection: HardenedHttpProtocol) -> ConnectionPool | None:
        """The pool `connection` joins, or None when both are full of busy connections."""
        for pool in (self.serving, self.probes):
            if pool.admit(connection):
                return pool
        return None


def probes_only(app: ASGI3Application, max_connections: int) -> ASGI3Application:
    """`app` for a connection admitted beyond the cap: the probe paths, and a JSON 503 for anything else."""
    refusal = TooManyConnections(
        f"all {max_connections} connections are in use; only {', '.join(sorted(PROBE_PATHS))} are answered "
        "beyond them: retry later",
        retry_after_s=1,
    )
    refused = refusal_response(refusal, {"connection": "close"})

    async def guarded(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] == "http" and scope["path"] not in PROBE_PATHS:
            await refused(scope, receive, send)  # type: ignore[arg-type]
            return
        await app(scope, receive, send)

    return guarded


class HardenedHttpProtocol(HttpToolsProtocol):
    """One connection, under its `ConnectionGuard`'s deadlines and cap (see the module docstring).

    uvicorn builds one per connection from ``Config(http=...)``, which therefore gets a
    ``functools.partial`` binding `guard`.
    """

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        guard: ConnectionGuard,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.guard = guard
        self._pool: ConnectionPool | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._in_message = False  # between a message's first byte and its last
        self._send_check: asyncio.TimerHandle | None = None
        self._unsent = 0  # `unsent_bytes` when the client last took some
        self._sent_at = 0.0  # and when that was seen

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._pool = self.guard.admit(self)
        if self._pool is None:
            log.warning("connection from %s refused: every connection is busy", self._peer())
            refusal = TooManyConnections(
                "the server's connections are all busy: retry later", retry_after_s=1
            )
            transport.write(error_bytes(refusal, self.server_state.default_headers))
            transport.close()
            return
        if self._pool is self.guard.probes:
            self.app = probes_only(self.app, self.guard.limits.max_connections)
        self._arm(self.guard.limits.header_timeout, "headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._stop_watching_sends()
        if self._pool is not None:
            self._pool.remove(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._pool is not None:
            self._pool.busy(self)
        # The first byte after an answer: the next request's headers are due. (Bytes that arrive while an
        # answer is still being computed wait for it; a request among them arms its own deadline.)
        if self._deadline is None and self.cycle.response_complete:
            self._arm(self.guard.limits.header_timeout, "headers")
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_message = True
        if self._deadline is None:  # a pipelined request, parsed from the same bytes as the one before
            self._arm(self.guard.limits.header_timeout, "headers")

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        self._arm(self.guard.limits.body_timeout, "body")

    def on_message_complete(self) -> None:
        self._in_message = False
        self._disarm()
        super().on_message_complete()
        if self.cycle.response_complete:  # answered before its body was read (a 413, a 401)
            self._went_idle()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.cycle.response_complete and not self._in_message:  # nothing pipelined or half-received
            self._went_idle()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_check is None:
            self._unsent, self._sent_at = unsent_bytes(self.transport), self.loop.time()
            self._check_sends_later()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_watching_sends()

    def send_400_response(self, msg: str) -> None:
        self.transport.write(error_bytes(Malformed(msg), self.server_state.default_headers))
        self.transport.close()

    def _went_idle(self) -> None:
        """No request in progress: displaceable, and closed after uvicorn's keep-alive timeout (which the
        rest of a body read after its answer cancelled)."""
        if self.transport.is_closing() or self._pool is None:
            return
        self._pool.idle(self)
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def _arm(self, seconds: float, what: str) -> None:
        self._deadline = self.loop.call_later(seconds, self._expired, seconds, what)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, seconds: float, what: str) -> None:
        self._deadline = None
        if self.flow.read_paused:  # the server holds the bytes back, not the client
            self._arm(seconds, what)
            return
        log.info(
            "closing the connection from %s: request %s not received within %g s", self._peer(), what, seconds
        )
        self.transport.close()

    def _check_sends_later(self) -> None:
        interval = self.guard.limits.send_timeout / SEND_CHECKS_PER_TIMEOUT
        self._send_check = self.loop.call_later(interval, self._check_sends)

    def _stop_watching_sends(self) -> None:
        if self._send_check is not None:
            self._send_check.cancel()
            self._send_check = None

    def _check_sends(self) -> None:
        """While writing is paused, nothing new is queued: fewer unsent bytes mean the client took some."""
        unsent, now = unsent_bytes(self.transport), self.loop.time()
        if unsent < self._unsent:
            self._unsent, self._sent_at = unsent, now
        elif now - self._sent_at >= self.guard.limits.send_timeout:
            self._send_check = None
            log.info(
                "aborting the connection from %s: no byte of its answer taken in %g s (%d bytes unsent)",
                self._peer(),
                now - self._sent_at,
                unsent,
            )
            self.guard.metrics.send_timeouts.inc()
            self.transport.abort()
            return
        self._check_sends_later()

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "an unknown peer"
