"""Request bodies read under a byte cap, so an oversized upload is refused before it is buffered."""

from __future__ import annotations

from starlette.requests import Request

from eagle3_target.server.refusals import TooLarge


async def read_body_capped(request: Request, limit: int) -> bytearray:
    """The whole body, or 413 as soon as the declared or the streamed length passes ``limit`` bytes.

    The declared length is the one the HTTP parser frames the body by: Content-Length, digits only (uvicorn's
    parser answers any other value with a 400, see ``http_protocol``), and none at all when Transfer-Encoding
    is present (RFC 9112 §6.3: the chunks frame the body and Content-Length is ignored). The buffer grows as
    the bytes arrive, never ahead of them: a connection that declares a large body and sends none costs no
    memory. The body is a writable bytearray, so the wire decoders return views of it instead of copying it
    again; it belongs to one request and is never reused, so those views stay valid.
    """
    declared = None if "transfer-encoding" in request.headers else request.headers.get("content-length")
    if declared is not None and int(declared) > limit:
        raise TooLarge(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        if len(body) + len(chunk) > limit:
            raise TooLarge(f"request body exceeds the limit of {limit} bytes")
        body += chunk
    return body
