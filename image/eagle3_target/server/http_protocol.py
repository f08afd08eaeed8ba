"""uvicorn's HTTP/1.1 protocol, answering the requests its parser rejects in the server's JSON error shape.

A request the HTTP parser cannot frame (``Content-Length: abc``, a negative length, a broken request line)
never reaches the app: uvicorn answers it itself with a plain-text 400. The error contract (errors.py)
promises every client a JSON error, so this subclass of the protocol uvicorn would pick anyway (httptools
when installed, else h11) renders that 400 as the app would render a ``BadRequest``. The connection is
closed either way.
"""

from __future__ import annotations

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from eagle3_target.server.errors import BadRequest


def bad_request_bytes(message: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A complete HTTP/1.1 400 response with a JSON error body, closing the connection."""
    response = BadRequest(message, headers={"connection": "close"}).response()
    lines = [b"HTTP/1.1 400 Bad Request"]
    lines += [name + b": " + value for name, value in [*default_headers, *response.raw_headers]]
    return b"\r\n".join(lines) + b"\r\n\r\n" + response.body


class JsonErrorHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    def send_400_response(self, msg: str) -> None:
        self.transport.write(bad_request_bytes(msg, self.server_state.default_headers))
        self.transport.close()
