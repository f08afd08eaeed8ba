"""The client's transport against real servers on loopback: keep-alive reuse, a server that closed an idle
connection, a body cut short, and nothing listening."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import threading
import time
from collections import deque

import pytest
import torch
from eagle3_target.client.transport import BodyBuffers, Refusal, Transport, TransportError, retry_after_s
from eagle3_target.wire.tensors import decode

from support.cluster.waiting import LOOPBACK, free_port
from support.server_process import AUTH_TOKEN, serve_in_thread


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


def test_a_read_that_times_out_on_a_reused_connection_is_sent_once():
    """A slow answer is no stale connection: the server may be computing it, and a second send would cost
    the caller twice the timeout and the server the work twice."""
    received: list[str] = []

    async def slow_peer(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        received.append(scope["path"])
        if scope["path"] == "/slow":
            await asyncio.sleep(3)  # past the client's timeout
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    transport = Transport({}, timeout_s=1, connect_timeout_s=5)
    with serve_in_thread(slow_peer) as url:
        assert bytes(transport.request("GET", url + "/fast").body) == b"ok"  # its connection is kept
        with pytest.raises(TransportError, match="timed out"):
            transport.request("GET", url + "/slow")  # on the kept connection
    transport.close()
    assert received == ["/fast", "/slow"]


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
    buffers = BodyBuffers(keep=2, min_bytes=1024)
    held = [buffers.take(2048 * n) for n in (1, 2, 3)]  # three back at once: only the `keep` largest stay
    addresses = [torch.frombuffer(b, dtype=torch.uint8).data_ptr() for b in held]
    del held
    gc.collect()
    assert torch.frombuffer(buffers.take(2048), dtype=torch.uint8).data_ptr() == addresses[1]
    assert torch.frombuffer(buffers.take(6144), dtype=torch.uint8).data_ptr() == addresses[2]


def test_a_body_the_collector_frees_inside_take_never_deadlocks_the_pool(llama_server):
    """The last view of a body can die in the cyclic GC (a batch kept in a reference cycle), and the GC runs
    wherever Python allocates: inside the pool's own `take` too, on the thread that holds its lock. Here
    nearly every allocation collects (threshold 1), and at some collections, drawn with a fixed seed, the
    collector frees the oldest body held, as it does when it finds a cycle dead: over thousands of bodies
    that lands inside `take` again and again (the pool that locked in its finalizer hung within hundreds)."""
    transport = Transport({"Authorization": f"Bearer {AUTH_TOKEN}"}, timeout_s=30, connect_timeout_s=5)
    transport.buffers = BodyBuffers(min_bytes=0)  # the 64 KiB weight pooled like a large batch
    held: deque[dict[str, torch.Tensor]] = deque()
    draw = random.Random(0)
    fetched: list[Refusal | None] = []

    def collector(phase: str, info: dict) -> None:
        if phase == "start" and threading.current_thread() is worker and held and draw.random() < 1 / 200:
            held.popleft()

    def fetch() -> None:
        for _ in range(3000):
            reply = transport.request("GET", llama_server.url + "/v1/weights/lm_head")
            held.append(decode(reply.body)[0])
            fetched.append(reply.refusal)

    worker = threading.Thread(target=fetch, daemon=True)
    thresholds = gc.get_threshold()
    gc.callbacks.append(collector)
    gc.set_threshold(1)
    try:
        worker.start()
        while worker.is_alive():
            before = len(fetched)
            worker.join(timeout=60)
            assert len(fetched) > before or not worker.is_alive(), f"hung after {len(fetched)} bodies"
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(collector)
    transport.close()
    assert fetched == [None] * 3000


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("3", 3.0),
        ("0.5", 0.5),
        ("-2", 0.0),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),
        ("soon", None),
        (None, None),
    ],
)
def test_retry_after_header_is_read_as_seconds(header, seconds):
    assert retry_after_s(header) == seconds
