"""Request bodies read under a byte cap, so an oversized upload is refused before it is buffered."""

from __future__ import annotations

from starlette.requests import Request

from eagle3_target.server.errors import PayloadTooLarge


async def read_body_capped(request: Request, limit: int) -> bytearray:
    """The whole body, or 413 as soon as the declared or the streamed length passes ``limit`` bytes.

    A declared Content-Length is digits only: uvicorn's HTTP parser answers any other value with a 400
    (``http_protocol``) before the app runs. The body is a writable bytearray, so the wire decoders return
    views of it instead of copying it again; it belongs to one request and is never reused, so those views
    stay valid.
    """
    declared = request.headers.get("content-length")
    if declared is not None and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
    return body
