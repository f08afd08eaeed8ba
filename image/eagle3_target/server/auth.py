"""Optional bearer-token check (``--auth-token-file``), as pure ASGI middleware.

Probes, the model's identity (/v1/info) and the metrics scrape stay open, so kubelet, Prometheus and the
operator need no secret; every route that returns tensors or changes state needs the token, and /readyz
names the clients that pull only to a caller that sends it (the rest see counts and ages). The
comparison is constant-time so response timing leaks nothing about the token. The file is re-read when it
changes, so a Secret rotated in place takes effect without a restart; the token before it stays accepted for
a grace period, until the trainers' copies of the Secret have caught up.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from eagle3_target.protocol import TokenFileError, read_token_file
from eagle3_target.server.errors import refusal_response
from eagle3_target.server.refusals import Unauthenticated
from eagle3_target.server.routes.probes import AUTHENTICATED, PROBE_PATHS

OPEN_PATHS = PROBE_PATHS | {"/v1/info"}
# How often the token file is looked at: a rotated Secret takes effect within this (plus the kubelet's sync).
TOKEN_CHECK_INTERVAL_S = 1.0
# How long the token before a rotation stays accepted. The kubelet updates each pod's copy of a Secret on its
# own sync (every minute) after its Secret cache expires, so a trainer's file can hold the old token ~60-90 s
# after the server's holds the new one; twice that covers it.
TOKEN_GRACE_PERIOD_S = 180.0

log = logging.getLogger(__name__)


class TokenFile:
    """The bearer token in a file that may change while the server runs.

    The kubelet updates a mounted Secret by swapping a `..data` symlink to a new timestamped directory, so
    `os.stat` (which follows the links) sees another inode, mtime or size; it is called at most once per
    `interval_s`, and only a change re-reads the file. A new token is accepted at once and the one before it
    for `grace_s` more (a second rotation within that drops the oldest). A file that is missing, unreadable
    or empty for a moment keeps the last good token, with one warning per problem (a token is never logged).
    `clock` is monotonic seconds. Used on the event loop only, so it needs no lock.
    """

    def __init__(
        self,
        path: Path,
        interval_s: float = TOKEN_CHECK_INTERVAL_S,
        grace_s: float = TOKEN_GRACE_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.interval_s = interval_s
        self.grace_s = grace_s
        self.clock = clock
        self._seen = self._stat()  # before the read: a change between the two is seen on the next check
        self._token = read_token_file(path)  # TokenFileError: a start without a token is refused
        self._checked = clock()
        self._problem: str | None = None
        self._previous: str | None = None
        self._previous_until = 0.0

    def admits(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header carries a token in force, each compared in constant time."""
        matches = [bearer_matches(authorization, token) for token in self.accepted()]  # all, no short cut
        return any(matches)

    def accepted(self) -> tuple[str, ...]:
        """The tokens in force: the file's, and the one before it during its grace period."""
        now = self.clock()
        if now - self._checked >= self.interval_s:
            self._checked = now
            self._reread(now)
        if self._previous is not None and now >= self._previous_until:
            self._previous = None
            log.info("the bearer token before the last rotation of %s is no longer accepted", self.path)
        return (self._token,) if self._previous is None else (self._token, self._previous)

    def _reread(self, now: float) -> None:
        seen = self._stat()
        if seen is not None and seen == self._seen:
            return
        try:
            token = read_token_file(self.path)
        except TokenFileError as exc:
            self._warn(str(exc))
            return
        self._seen, self._problem = seen, None
        if token != self._token:
            self._previous, self._previous_until, self._token = self._token, now + self.grace_s, token
            log.info(
                "bearer token file %s changed: its new token is accepted, and the previous one for %gs "
                "more while the kubelet updates the trainers' copies of the Secret",
                self.path,
                self.grace_s,
            )

    def _stat(self) -> tuple[int, int, int, int] | None:
        try:
            stat = os.stat(self.path)
        except OSError:
            return None  # read_token_file says why
        return stat.st_dev, stat.st_ino, stat.st_mtime_ns, stat.st_size

    def _warn(self, problem: str) -> None:
        if problem != self._problem:
            self._problem = problem
            log.warning("%s; the previous bearer token stays in force", problem)


def bearer_matches(authorization: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header carries exactly ``Bearer <token>``."""
    if not authorization:
        return False
    scheme, _, presented = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(presented.strip().encode(), token.encode())


class BearerAuthMiddleware:
    """Rejects requests without the right bearer token with 401 before any route runs."""

    def __init__(self, app: ASGIApp, tokens: TokenFile) -> None:
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        authorization = headers.get(b"authorization", b"").decode("latin-1") or None
        authenticated = self.tokens.admits(authorization)
        if scope["path"] in OPEN_PATHS:  # open, but /readyz names its clients only to the token's holder
            scope.setdefault("state", {})[AUTHENTICATED] = authenticated
            await self.app(scope, receive, send)
            return
        if authenticated:
            await self.app(scope, receive, send)
            return
        error = refusal_response(Unauthenticated("missing or wrong bearer token"))
        await error(scope, receive, send)
