"""Supervision responses streamed from the tensors' own memory.

The body is a `wire.Payload`: a few bytes of framing, then views of each tensor. It goes to the socket in
chunks of `CHUNK_BYTES`, each awaited through the server's flow control, so the event loop never holds or
copies a whole body, a slow reader holds back only its own response, and the chunks of responses to several
clients interleave (a small answer is not stuck behind another client's large one).
"""

from __future__ import annotations

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from eagle3_target.protocol import OCTET_STREAM
from eagle3_target.wire import Payload

# Large enough that a write is one cheap syscall per MiB, small enough that responses interleave finely.
CHUNK_BYTES = 1 << 20


class PayloadResponse(Response):
    """A 200 whose body is ``payload``, sent chunk by chunk with its exact Content-Length."""

    media_type = OCTET_STREAM

    def __init__(self, payload: Payload, *, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.payload = payload
        self.chunk_bytes = chunk_bytes
        self.status_code = 200
        self.background = None
        self.init_headers({"content-length": str(payload.nbytes)})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for chunk in self.payload.chunks(self.chunk_bytes):
            # uvicorn waits here while the socket's buffer is full, and returns at once once the client
            # has gone, so an abandoned response costs no more than walking its chunk list.
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
