"""Why the server refuses a request, in its own terms.

Every door into the server (the native HTTP API, NeMo's routes, the NCCL group, the Mooncake store) runs the
same supervision service, which raises these; each door says them its own way (`errors.py` for HTTP, a
status word for NeMo's ``/init_nccl``). A refusal's ``kind`` is the stable machine-readable reason clients
branch on; ``retry_after_s`` says the refusal passes and when to come back.
"""

from __future__ import annotations

from typing import ClassVar


class Refused(Exception):
    """A request the server will not answer, and why."""

    kind: ClassVar[str] = "internal_error"

    def __init__(
        self, message: str, *, retry_after_s: float | None = None, details: dict[str, object] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        self.details = details or {}


class Malformed(Refused):
    """The request cannot be read: a body that is not the wire format it claims, bad framing."""

    kind = "bad_request"


class Unauthenticated(Refused):
    """No bearer token in force came with a request that needs one."""

    kind = "unauthorized"


class Unknown(Refused):
    """The request names something the server does not hold: a vocab mapping, a weight, a route."""

    kind = "not_found"


class TooLarge(Refused):
    """The request, or the answer it would get, is over a size limit: send less per request."""

    kind = "payload_too_large"


class Invalid(Refused):
    """The request reads but makes no sense for this target (ids out of range, an unknown format)."""

    kind = "invalid_input"


class Busy(Refused):
    """The engine's queue is full: come back shortly."""

    kind = "queue_full"


class ClientGone(Refused):
    """The client left before its request was read or its answer computed: nobody reads the answer."""

    kind = "client_closed_request"


class NotReady(Refused):
    """The model is loading, failed to load, or its engine died."""

    kind = "not_ready"


class AnswerMemoryFull(Refused):
    """The answers in flight hold ``--max-response-bytes-in-flight`` already (streaming.AnswerMemory)."""

    kind = "answer_memory_full"


class TooManyConnections(Refused):
    """The server's connection cap is reached (http_protocol)."""

    kind = "too_many_connections"


class TransportUnavailable(Refused):
    """The transport the client asked for is off on this server, or its group or store is gone."""

    kind = "transport_unavailable"
