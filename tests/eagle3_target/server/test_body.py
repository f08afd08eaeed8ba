"""Reading request bodies: the byte cap, a buffer the wire decoders can view without copying, and no memory
spent on a declared body before its bytes arrive."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from eagle3_target.server.body import read_body_capped
from eagle3_target.server.refusals import TooLarge
from eagle3_target.server.settings import ServerSettings
from eagle3_target.wire import tensors as tensor_wire
from starlette.requests import Request
from starlette.types import Message

from support.cluster.waiting import eventually
from support.server_process import ServerProcess, connect, start_server
from support.supervision import metric_samples

SILENT = 50
ROOMY_BATCH_TOKENS = 262144  # a 6.3 MiB body limit


def request_streaming(
    chunks: list[bytes], content_length: int | None = None, transfer_encoding: str | None = None
) -> Request:
    """A Starlette request whose ASGI receive hands out ``chunks`` as the server would."""
    messages: list[Message] = [
        {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
        for i, chunk in enumerate(chunks)
    ]
    headers = [] if content_length is None else [(b"content-length", str(content_length).encode())]
    if transfer_encoding is not None:
        headers.append((b"transfer-encoding", transfer_encoding.encode()))

    async def receive() -> Message:
        return messages.pop(0)

    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive)


def test_the_body_is_decoded_in_place_without_another_copy():
    payload = tensor_wire.encode({"input_ids": torch.arange(12, dtype=torch.int64).reshape(3, 4)})
    chunks = [payload[:50], payload[50:]]
    body = asyncio.run(read_body_capped(request_streaming(chunks, len(payload)), limit=len(payload)))
    assert isinstance(body, bytearray) and body == payload
    tensors, _ = tensor_wire.decode(body)
    assert int(tensors["input_ids"][-1, -1]) == 11
    # A view, not a copy: changing the body's last byte changes the decoded tensor.
    body[-8:] = (99).to_bytes(8, "little")
    assert int(tensors["input_ids"][-1, -1]) == 99


def test_the_cap_holds_for_declared_and_streamed_lengths():
    with pytest.raises(TooLarge, match="101 bytes"):
        asyncio.run(read_body_capped(request_streaming([b"x" * 101], 101), limit=100))
    with pytest.raises(TooLarge, match="exceeds the limit of 100 bytes"):
        asyncio.run(read_body_capped(request_streaming([b"x" * 60, b"x" * 60]), limit=100))


def test_transfer_encoding_frames_the_body_not_content_length():
    """RFC 9112 §6.3: with Transfer-Encoding, Content-Length is ignored; the streamed length still caps."""
    chunked = request_streaming([b"abc", b""], content_length=99_999_999_999, transfer_encoding="chunked")
    assert asyncio.run(read_body_capped(chunked, limit=100)) == b"abc"
    oversized = request_streaming([b"x" * 60, b"x" * 60], content_length=10, transfer_encoding="chunked")
    with pytest.raises(TooLarge, match="exceeds the limit of 100 bytes"):
        asyncio.run(read_body_capped(oversized, limit=100))


def test_the_stream_decides_the_size_not_the_declared_length():
    payload = bytes(range(200))
    exact = asyncio.run(read_body_capped(request_streaming([payload[:7], payload[7:]], 200), limit=1000))
    assert isinstance(exact, bytearray) and exact == payload
    # Without a parser in front, a stream may differ from its declaration: the bytes that came are the body.
    longer = asyncio.run(read_body_capped(request_streaming([payload[:150], payload[150:]], 100), limit=1000))
    shorter = asyncio.run(read_body_capped(request_streaming([payload[:50]], 100), limit=1000))
    assert (longer, shorter) == (payload, payload[:50])


@pytest.fixture(scope="module")
def roomy_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("roomy"),
        [
            "--model", str(server_model_dir), "--engine", "hf", "--dtype", "float32",
            "--max-batch-tokens", str(ROOMY_BATCH_TOKENS),
        ],
    )  # fmt: skip
    yield proc
    proc.stop()


def test_connections_that_declare_large_bodies_and_send_none_cost_no_memory(roomy_server):
    url = roomy_server.url
    limit = ServerSettings(model="unused", max_batch_tokens=ROOMY_BATCH_TOKENS).token_body_limit
    head = f"POST /v1/supervision HTTP/1.1\r\nHost: x\r\nContent-Length: {limit}\r\n\r\n".encode()
    before = roomy_server.memory_mib()["VmRSS"]
    silent = [connect(url) for _ in range(SILENT)]
    try:
        for sock in silent:
            sock.sendall(head)
        # Each is in its route, waiting for the body (the scrape that asks is in flight too).
        eventually(
            lambda: metric_samples(url)[("eagle3_inflight_requests", ())] == SILENT + 1,
            "every request to wait for its body",
        )
        grown = roomy_server.memory_mib()["VmRSS"] - before
    finally:
        for sock in silent:
            sock.close()
    declared_mib = SILENT * limit / 2**20
    assert grown < declared_mib / 16, (
        f"RSS grew {grown:.0f} MiB for {declared_mib:.0f} MiB declared, none sent"
    )
