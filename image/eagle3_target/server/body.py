"""Request bodies read under a byte cap, so an oversized upload is refused before it is buffered."""

from __future__ import annotations

from starlette.requests import Request

from eagle3_target.server.errors import BadRequest, PayloadTooLarge


async def read_body_capped(request: Request, limit: int) -> bytearray:
    """The whole body, or 413 as soon as the declared or the streamed length passes ``limit`` bytes.

    A writable bytearray, so the wire decoders return views of it instead of copying it again; it belongs
    to one request and is never reused, so those views stay valid.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise BadRequest(f"invalid Content-Length header {declared!r}")
        if int(declared) > limit:
            raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
    return body
