"""The server's error contract: every failure is JSON ``{"error": {"type", "message"}}``.

Handlers raise an ``ApiError`` subclass; one exception handler renders it. Framework errors (unknown route,
wrong method, FastAPI validation) and unexpected exceptions are rendered the same way, so a client never has
to parse HTML or plain text.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error with an HTTP status and a stable machine-readable type."""

    status = 500
    type = "internal_error"

    def __init__(
        self, message: str, *, headers: dict[str, str] | None = None, details: dict[str, object] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}
        self.details = details or {}

    def response(self) -> JSONResponse:
        return error_response(self.status, self.type, self.message, self.headers, self.details)


class BadRequest(ApiError):
    status, type = 400, "bad_request"


class Unauthorized(ApiError):
    status, type = 401, "unauthorized"


class NotFound(ApiError):
    status, type = 404, "not_found"


class PayloadTooLarge(ApiError):
    status, type = 413, "payload_too_large"


class Unprocessable(ApiError):
    status, type = 422, "invalid_input"


class TooManyRequests(ApiError):
    status, type = 429, "queue_full"


class ClientClosedRequest(ApiError):
    """The client closed the connection before its request was read or its answer computed (nginx's 499).
    Nobody reads the answer; the status is there for the access log and ``eagle3_requests_total``, which
    would otherwise say 500."""

    status, type = 499, "client_closed_request"


class NotReady(ApiError):
    status, type = 503, "not_ready"


class AnswerMemoryFull(ApiError):
    """The answers in flight hold ``--max-response-bytes-in-flight`` already (streaming.AnswerMemory)."""

    status, type = 503, "answer_memory_full"


class TooManyConnections(ApiError):
    """The server's connection cap is reached (http_protocol): sent by the protocol, not by a route."""

    status, type = 503, "too_many_connections"


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

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(exc.status_code, type_, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        reasons = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return Unprocessable(reasons).response()

    @app.exception_handler(ClientDisconnect)
    async def _client_disconnect(_request: Request, _exc: ClientDisconnect) -> JSONResponse:
        return ClientClosedRequest("the client closed the connection before its request was read").response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return ApiError(f"{type(exc).__name__}: {exc}").response()
