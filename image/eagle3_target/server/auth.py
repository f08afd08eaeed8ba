"""Optional bearer-token check (``--auth-token-file``), as pure ASGI middleware.

Probes, the model's identity (/v1/info) and the metrics scrape stay open, so kubelet, Prometheus and the
operator need no secret; every route that returns tensors or changes state needs the token, and /readyz
names the clients that pull only to a caller that sends it (the rest see counts and ages). The
comparison is constant-time so response timing leaks nothing about the token.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from eagle3_target.server.errors import Unauthorized
from eagle3_target.server.routes.probes import AUTHENTICATED, PROBE_PATHS

OPEN_PATHS = PROBE_PATHS | {"/v1/info"}


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

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        authorization = headers.get(b"authorization", b"").decode("latin-1") or None
        authenticated = bearer_matches(authorization, self.token)
        if scope["path"] in OPEN_PATHS:  # open, but /readyz names its clients only to the token's holder
            scope.setdefault("state", {})[AUTHENTICATED] = authenticated
            await self.app(scope, receive, send)
            return
        if authenticated:
            await self.app(scope, receive, send)
            return
        error = Unauthorized("missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)
