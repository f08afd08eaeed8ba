"""Per-request bookkeeping as pure ASGI middleware: request id, access log and request metrics.

Pure ASGI (not BaseHTTPMiddleware) so large supervision bodies stream through untouched.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from eagle3_target.server.logs import request_id_var
from eagle3_target.server.metrics import ServerMetrics

log = logging.getLogger("eagle3_target.server.access")

_REQUEST_ID_OK = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def pick_request_id(presented: str | None) -> str:
    """The caller's X-Request-ID when it is a sane token, else a fresh one (never echo arbitrary bytes)."""
    if presented and _REQUEST_ID_OK.match(presented):
        return presented
    return uuid.uuid4().hex


def route_label(scope: Scope) -> str:
    """The matched route's template (bounded label cardinality), or ``unmatched``."""
    route = scope.get("route")
    return getattr(route, "path", None) or "unmatched"


class RequestTrackingMiddleware:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        request_id = pick_request_id(headers.get(b"x-request-id", b"").decode("latin-1"))
        token = request_id_var.set(request_id)
        status = 500
        started = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        self.metrics.inflight.inc()
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.metrics.inflight.dec()
            elapsed = time.perf_counter() - started
            route = route_label(scope)
            self.metrics.requests.labels(route=route, code=str(status)).inc()
            self.metrics.request_duration.labels(route=route).observe(elapsed)
            log.info(
                "%s %s %d",
                scope["method"],
                scope["path"],
                status,
                extra={"route": route, "status": status, "duration_s": round(elapsed, 6)},
            )
            request_id_var.reset(token)
