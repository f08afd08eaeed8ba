"""The server's HTTP error contract: every failure is JSON ``{"error": {"type", "message"}}``.

Handlers and the service below them raise a `refusals.Refused`; one exception handler gives it the HTTP status
of its kind. Framework errors (unknown route, wrong method, FastAPI validation) and unexpected exceptions are
rendered the same way, so a client never has to parse HTML or plain text.
"""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from eagle3_target.server.refusals import (
    AnswerMemoryFull,
    Busy,
    ClientGone,
    Invalid,
    Malformed,
    NotReady,
    Refused,
    TooLarge,
    TooManyConnections,
    TransportUnavailable,
    Unauthenticated,
    Unknown,
)

log = logging.getLogger(__name__)

# Each refusal's HTTP status. 499 (nginx's "client closed request") is for the access log and
# ``eagle3_requests_total``, which would otherwise say 500: nobody reads the answer.
HTTP_STATUS: dict[type[Refused], int] = {
    Refused: 500,
    Malformed: 400,
    Unauthenticated: 401,
    Unknown: 404,
    TooLarge: 413,
    Invalid: 422,
    Busy: 429,
    ClientGone: 499,
    NotReady: 503,
    AnswerMemoryFull: 503,
    TooManyConnections: 503,
    TransportUnavailable: 503,
}


def http_status(refused: Refused) -> int:
    return HTTP_STATUS[type(refused)]


def refusal_response(refused: Refused, headers: dict[str, str] | None = None) -> JSONResponse:
    """``refused`` as its JSON error with its status, Retry-After when it passes, and ``headers``."""
    sent = dict(headers or {})
    if refused.retry_after_s is not None:
        sent["retry-after"] = str(max(1, math.ceil(refused.retry_after_s)))
    if isinstance(refused, Unauthenticated):
        sent["www-authenticate"] = "Bearer"
    return error_response(http_status(refused), refused.kind, refused.message, sent, refused.details)


def error_response(
    status: int,
    type_: str,
    message: str,
    headers: dict[str, str] | None = None,
    details: dict[str, object] | None = None,
) -> JSONResponse:
    """The error body; `details` are members beside "error" that say more (a 503's load progress)."""
    body = {"error": {"type": type_, "message": message}, **(details or {})}
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception the app can raise into the JSON error shape."""

    @app.exception_handler(Refused)
    async def _refused(_request: Request, exc: Refused) -> JSONResponse:
        return refusal_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(exc.status_code, type_, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        reasons = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return refusal_response(Invalid(reasons))

    @app.exception_handler(ClientDisconnect)
    async def _client_disconnect(_request: Request, _exc: ClientDisconnect) -> JSONResponse:
        return refusal_response(ClientGone("the client closed the connection before its request was read"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return refusal_response(Refused(f"{type(exc).__name__}: {exc}"))
