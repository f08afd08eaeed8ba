"""The client's transport against real servers on loopback: keep-alive reuse, a server that closed an idle
connection, a body cut short, and nothing listening."""

from __future__ import annotations

import gc
import json
import time

import pytest
import torch
from eagle3_target.client.transport import BodyBuffers, Transport, TransportError

from support.cluster.waiting import LOOPBACK, free_port
from support.server_process import serve_in_thread


async def echo_peer(scope, receive, send) -> None:
    """Answers with the client's port (which connection it came on) and, on /cut, half a body."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    body = json.dumps({"port": scope["client"][1]}).encode()
    declared = len(body) * (2 if scope["path"] == "/cut" else 1)
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % declared)]}
    )
    await send({"type": "http.response.body", "body": body})


def port_of(transport: Transport, url: str) -> int:
    return json.loads(bytes(transport.request("POST", url + "/", content=b"x").body))["port"]


def test_connections_are_kept_alive_and_a_closed_idle_one_is_replaced_silently():
    transport = Transport({}, timeout_s=10, connect_timeout_s=5)
    with serve_in_thread(echo_peer) as url:  # uvicorn's default: idle connections closed after 5 s
        first = port_of(transport, url)
        assert port_of(transport, url) == first  # the same connection
        time.sleep(6)  # the server closes it meanwhile
        assert port_of(transport, url) != first  # a fresh one, and no error
    transport.close()


def test_a_body_cut_short_and_a_dead_endpoint_are_transport_errors():
    transport = Transport({}, timeout_s=10, connect_timeout_s=5)
    with serve_in_thread(echo_peer) as url, pytest.raises(TransportError, match="of its"):
        transport.request("GET", url + "/cut")
    with pytest.raises(TransportError, match="ConnectionRefused"):
        transport.request("GET", f"http://{LOOPBACK}:{free_port()}/")


def test_a_body_buffer_is_reused_only_once_nothing_views_it():
    buffers = BodyBuffers(keep=1, min_bytes=1024)
    first = buffers.take(4096)
    first[:4] = b"abcd"
    tensor = torch.frombuffer(first, dtype=torch.uint8)  # what decoding a body does
    del first
    second = buffers.take(4096)
    assert torch.frombuffer(second, dtype=torch.uint8).data_ptr() != tensor.data_ptr()  # still in use
    assert bytes(tensor[:4].numpy()) == b"abcd"
    address = tensor.data_ptr()
    del tensor
    gc.collect()
    assert torch.frombuffer(buffers.take(4000), dtype=torch.uint8).data_ptr() == address  # given back
    assert isinstance(buffers.take(100), memoryview)  # small bodies are not pooled


def test_the_pool_picks_the_smallest_idle_buffer_that_fits_among_several():
    buffers = BodyBuffers(keep=2, min_bytes=1024)
    small, large = buffers.take(4096), buffers.take(8000)
    small_address, large_address = (torch.frombuffer(b, dtype=torch.uint8).data_ptr() for b in (small, large))
    del small, large
    gc.collect()
    assert torch.frombuffer(buffers.take(7000), dtype=torch.uint8).data_ptr() == large_address
    assert torch.frombuffer(buffers.take(4096), dtype=torch.uint8).data_ptr() == small_address
    held = [buffers.take(2048 * n) for n in (1, 2, 3)]  # three back at once: only `keep` of them stay
    del held
    gc.collect()
    assert len(buffers._idle) == 2
