"""Hostile connections against real `eagle3-target serve` processes: requests that never finish are closed
after their deadline, the connection cap answers JSON 503 while probes still get through, and a process
short of file descriptors keeps loading its model and answering /readyz."""

from __future__ import annotations

import json
import logging
import os
import resource
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import httpx
import pytest
from eagle3_target.server.http_protocol import (
    FD_RESERVE,
    MAX_BACKLOG,
    PROBE_CONNECTIONS,
    connection_budget,
)

from support.cluster.waiting import LOOPBACK, eventually, free_port
from support.server_process import ServerProcess, connect, serve_command, start_server
from support.supervision import assert_error, assert_still_serving, metric_samples

HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 2.0
CAP = 3
LOW_FD_LIMIT = 256
IDLE_SOCKETS = 300
ROUTE = "/v1/supervision"


def tiny_server_args(model_dir: Path) -> list[str]:
    return ["--model", str(model_dir), "--engine", "hf", "--dtype", "float32", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def deadlines_server(
    server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("deadlines"),
        [
            *tiny_server_args(server_model_dir),
            "--request-header-timeout", str(HEADER_TIMEOUT),
            "--request-body-timeout", str(BODY_TIMEOUT),
        ],
    )  # fmt: skip
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def capped_server(
    server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """Three connections, and deadlines long enough for the test to hold its half-sent requests."""
    proc = start_server(
        tmp_path_factory.mktemp("capped"),
        [
            *tiny_server_args(server_model_dir),
            "--max-connections", str(CAP),
            "--request-header-timeout", "120",
        ],
    )  # fmt: skip
    yield proc
    proc.stop()


def half_sent(url: str) -> socket.socket:
    """A connection with a request whose headers never end."""
    sock = connect(url)
    sock.sendall(b"GET /readyz HTTP/1.1\r\nHost: localhost\r\n")
    return sock


def busy(url: str) -> socket.socket:
    """A connection the server has read a request and a half from: answered once, then stuck in the second
    request's headers, so nothing displaces it."""
    sock = connect(url)
    sock.sendall(
        b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\nGET /healthz HTTP/1.1\r\nHost: localhost\r\n"
    )
    with sock.makefile("rb") as reader:
        assert read_response(reader)[0] == 200
    return sock


def seconds_until_closed(sock: socket.socket) -> float:
    """How long the server takes to close `sock` without answering (fails if it answers instead)."""
    started = time.monotonic()
    assert sock.recv(65536) == b""
    return time.monotonic() - started


def read_response(reader: BinaryIO) -> tuple[int, dict[str, str], bytes]:
    """One response with a Content-Length body, read off a socket's buffered `reader` (which keeps the bytes
    of the responses after it)."""
    status_line = reader.readline().decode("latin-1")
    assert status_line, "closed before an answer"
    headers = {}
    while (line := reader.readline().decode("latin-1").rstrip("\r\n")) != "":
        name, _, value = line.partition(": ")
        headers[name.lower()] = value
    return int(status_line.split()[1]), headers, reader.read(int(headers["content-length"]))


def ask(url: str, path: str) -> tuple[int, dict[str, str], bytes]:
    with connect(url) as sock, sock.makefile("rb") as reader:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
        return read_response(reader)


def assert_too_many_connections(status: int, headers: dict[str, str], payload: bytes) -> str:
    assert status == 503
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    error = json.loads(payload)["error"]
    assert error["type"] == "too_many_connections"
    return error["message"]


def request_count(url: str, route: str, code: str) -> float:
    key = ("eagle3_requests_total", (("code", code), ("route", route)))
    return metric_samples(url).get(key, 0.0)


def test_a_connection_that_never_finishes_its_headers_is_closed(deadlines_server):
    with half_sent(deadlines_server.url) as partial, connect(deadlines_server.url) as silent:
        assert seconds_until_closed(partial) >= HEADER_TIMEOUT * 0.9
        seconds_until_closed(silent)  # a connection that never sends a byte goes the same way
    assert "request headers not received" in deadlines_server.log()
    assert_still_serving(deadlines_server.url)


def test_a_stalled_body_is_closed_and_counted_as_the_client_closing(deadlines_server):
    url = deadlines_server.url
    closed_early, failed = request_count(url, ROUTE, "499"), request_count(url, ROUTE, "500")
    with connect(url) as sock:
        sock.sendall(
            b"POST /v1/supervision HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + b"\0" * 100
        )
        assert seconds_until_closed(sock) >= BODY_TIMEOUT * 0.9
    # The route reading the body saw a disconnect: a 499, not a 500.
    eventually(lambda: request_count(url, ROUTE, "499") > closed_early, "the 499 to be counted")
    assert request_count(url, ROUTE, "499") == closed_early + 1
    assert request_count(url, ROUTE, "500") == failed
    assert "request body not received" in deadlines_server.log()
    assert_still_serving(url)


def test_an_idle_keep_alive_connection_outlives_the_header_timeout(deadlines_server):
    """The header deadline runs from a request's first byte, not between requests (NeMo's session idles)."""
    with connect(deadlines_server.url) as sock, sock.makefile("rb") as reader:
        for _ in range(2):
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
            status, _, payload = read_response(reader)
            assert status == 200 and json.loads(payload) == {"status": "ok"}
            time.sleep(HEADER_TIMEOUT * 2)


def test_pipelined_requests_are_all_answered(deadlines_server):
    """The second request's deadlines wait while the first is answered (its bytes are read afterwards)."""
    with connect(deadlines_server.url) as sock, sock.makefile("rb") as reader:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n" * 2 + b"GET /v1/info HTTP/1.1\r\n")
        assert [read_response(reader)[0] for _ in range(2)] == [200, 200]
        sock.sendall(b"Host: localhost\r\n\r\n")
        status, _, payload = read_response(reader)
        assert status == 200 and "fingerprint" in json.loads(payload)


def test_beyond_the_cap_requests_get_a_json_503_and_probes_still_answer(capped_server):
    url = capped_server.url
    held = [busy(url) for _ in range(CAP)]
    try:
        message = assert_too_many_connections(*ask(url, "/v1/info"))
        assert f"all {CAP} connections" in message
        assert_error(httpx.get(url + "/v1/info", timeout=30), 503, "too_many_connections")
        for probe in ("/readyz", "/healthz", "/metrics"):
            assert ask(url, probe)[0] == 200, probe
        held += [busy(url) for _ in range(PROBE_CONNECTIONS)]
        # Every connection, probe ones too, is busy: a new one is answered at once, before it sends a byte.
        with connect(url) as refused, refused.makefile("rb") as reader:
            status, headers, payload = read_response(reader)
        assert_too_many_connections(status, headers, payload)
        assert headers["retry-after"] == "1"
    finally:
        for sock in held:
            sock.close()
    eventually(lambda: ask(url, "/v1/info")[0] == 200, "the cap to free up once the connections close")


def test_idle_connections_make_way_for_new_ones(capped_server):
    url = capped_server.url
    idle = [connect(url) for _ in range(CAP + PROBE_CONNECTIONS)]
    try:
        # Accepted in the order they connected, so all are admitted when the request's connection arrives.
        response = httpx.get(url + "/v1/info", timeout=30)
        assert response.status_code == 200, response.text
        readable, _, _ = select.select(idle, [], [], 10)
        assert any(sock.recv(1) == b"" for sock in readable)  # the longest-idle one was closed to make way
    finally:
        for sock in idle:
            sock.close()


def start_with_fd_limit(log_dir: Path, args: list[str], limit: int) -> ServerProcess:
    """A server whose process may open at most `limit` files (soft and hard)."""
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [*serve_command(), "serve", "--host", LOOPBACK, "--port", str(port), *args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)),
        )
    return ServerProcess(f"http://{LOOPBACK}:{port}", process, log_path)


def open_idle(url: str, count: int) -> list[socket.socket]:
    """Up to `count` connections that send nothing; the ones the server turns away are closed at once."""
    sockets = []
    for _ in range(count):
        try:
            sockets.append(connect(url))
        except OSError:
            continue
    return sockets


def test_short_of_file_descriptors_the_model_loads_and_readyz_answers(server_model_dir, tmp_path):
    server = start_with_fd_limit(tmp_path, tiny_server_args(server_model_dir), LOW_FD_LIMIT)
    idle: list[socket.socket] = []
    try:
        server.wait_until("/healthz", 200)
        idle = open_idle(server.url, IDLE_SOCKETS)  # the model may still be loading
        assert len(idle) > LOW_FD_LIMIT // 2
        server.wait_until("/readyz", 200)
        idle += open_idle(server.url, IDLE_SOCKETS)
        assert httpx.get(server.url + "/readyz", timeout=30).status_code == 200
        assert_still_serving(server.url)
    finally:
        for sock in idle:
            sock.close()
        server.stop()
    log = server.log()
    assert "max_connections lowered from 1024" in log
    assert "Too many open files" not in log and "model load failed" not in log
    assert "out of system resource" not in log


def test_the_connection_budget_fits_the_fd_limit(caplog):
    with caplog.at_level(logging.WARNING, logger="eagle3_target.server.http_protocol"):
        roomy = connection_budget(1024, 1_048_576, open_fds=20)
    assert (roomy.max_connections, roomy.backlog) == (1024, MAX_BACKLOG) and not caplog.records
    with caplog.at_level(logging.WARNING, logger="eagle3_target.server.http_protocol"):
        tight = connection_budget(1024, LOW_FD_LIMIT, open_fds=20)
    total = tight.max_connections + PROBE_CONNECTIONS + tight.backlog + 20 + FD_RESERVE
    assert 1 <= tight.max_connections < 1024 and total <= LOW_FD_LIMIT
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        f"max_connections lowered from 1024 to {tight.max_connections}"
    ]
    assert connection_budget(1024, 64, open_fds=20).max_connections == 1  # always serves someone


def test_the_soft_fd_limit_is_raised_to_the_hard_one():
    script = (
        "import resource; from eagle3_target.server.http_protocol import raise_fd_limit; "
        "print(raise_fd_limit(), *resource.getrlimit(resource.RLIMIT_NOFILE))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (LOW_FD_LIMIT, 4 * LOW_FD_LIMIT)),
    ).stdout
    assert out.split() == [str(4 * LOW_FD_LIMIT)] * 3
