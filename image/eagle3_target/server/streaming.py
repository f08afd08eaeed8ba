"""Supervision responses streamed from the tensors' own memory.

The body is a `wire.Payload`: a few bytes of framing, then views of each tensor. It goes to the socket in
chunks of `CHUNK_BYTES`, each awaited through the server's flow control, so the event loop never holds or
copies a whole body, a slow reader holds back only its own response, and the chunks of responses to several
clients interleave (a small answer is not stuck behind another client's large one).

Answers are held in memory until their last byte is sent, so two things bound what they hold: a connection
whose client takes no byte for ``--response-send-timeout`` is closed (http_protocol), which ends its response
at once, and `AnswerMemory` caps the bytes of each answer and of all answers in flight.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from eagle3_target.protocol import OCTET_STREAM
from eagle3_target.server.metrics import ServerMetrics
from eagle3_target.server.refusals import AnswerMemoryFull, TooLarge
from eagle3_target.wire import Payload

# A stalled answer is let go within --response-send-timeout; most answers take far less.
RETRY_AFTER_SECONDS = 1

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


class AnswerHold:
    """The bytes one request's answer holds, taken in `AnswerMemory` before its compute."""

    def __init__(self, memory: AnswerMemory) -> None:
        self._memory = memory
        self.nbytes = 0

    def take(self, nbytes: int) -> None:
        """Count ``nbytes`` more for this answer (503 when they would pass the cap on answers in flight)."""
        self._memory.reserve(nbytes)
        self.nbytes += nbytes

    def take_answer(self, nbytes: int, tokens: int) -> None:
        """`take` the answer for ``tokens`` tokens, but 413 first when it is over the per-request limit."""
        self._memory.refuse_oversized(nbytes, tokens)
        self.take(nbytes)


class AnswerMemory:
    """The bytes all answers in flight hold, from before their compute until their last byte is sent or
    their connection is gone, capped at ``in_flight_limit``; one answer is capped at ``answer_limit``. Used
    from the event loop only, so it needs no lock."""

    def __init__(self, *, answer_limit: int, in_flight_limit: int, metrics: ServerMetrics) -> None:
        self.answer_limit = answer_limit
        self.in_flight_limit = in_flight_limit
        self.metrics = metrics
        self.held = 0

    def refuse_oversized(self, nbytes: int, tokens: int) -> None:
        """413 before any compute when an answer would not fit the per-request limit."""
        if nbytes > self.answer_limit:
            raise TooLarge(
                f"the answer for {tokens} tokens would be {nbytes} bytes, over this server's limit of "
                f"{self.answer_limit} bytes per response (--max-response-bytes): send fewer tokens per "
                "request",
                details={"response_bytes": nbytes, "max_response_bytes": self.answer_limit},
            )

    def reserve(self, nbytes: int) -> None:
        """Hold ``nbytes`` more; 503 with Retry-After when they would pass the cap beside the other answers
        in flight. A lone answer is always admitted (its size is capped per request), so a request the
        server accepts is served once the others are gone."""
        if self.held and self.held + nbytes > self.in_flight_limit:
            self.metrics.answer_memory_refusals.inc()
            raise AnswerMemoryFull(
                f"the answers in flight hold {self.held} bytes; this one's {nbytes} would pass the limit "
                f"of {self.in_flight_limit} (--max-response-bytes-in-flight): retry shortly",
                retry_after_s=RETRY_AFTER_SECONDS,
                details={
                    "answer_bytes": nbytes,
                    "held_bytes": self.held,
                    "limit_bytes": self.in_flight_limit,
                },
            )
        self._add(nbytes)

    def _add(self, nbytes: int) -> None:
        self.held += nbytes
        self.metrics.answer_bytes_in_flight.set(self.held)

    @contextmanager
    def request(self) -> Iterator[AnswerHold]:
        """One request's hold, given back when the request ends however it ends."""
        hold = AnswerHold(self)
        try:
            yield hold
        finally:
            self._add(-hold.nbytes)
