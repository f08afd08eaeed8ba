"""Random bodies on every route that reads one: always a JSON 4xx, never a 5xx, and the server lives on."""

from __future__ import annotations

import json
import struct

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.cluster.waiting import eventually
from support.server_process import connect
from support.supervision import assert_still_serving, metric_samples

NEMO_MAGIC = struct.pack("<I", 0x4E4D4554)
BODY_ROUTES = [
    ("POST", "/v1/supervision"),
    ("POST", "/v1/supervision?format=logits"),
    ("PUT", "/v1/vocab-mappings/fuzz"),
    ("POST", "/set_vocab_mapping"),
    ("POST", "/generate"),
]


def safetensors_like(header: bytes, data: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + data


bodies = st.one_of(
    st.binary(max_size=4096),
    st.builds(lambda tail: NEMO_MAGIC + tail, st.binary(max_size=512)),
    st.builds(safetensors_like, st.binary(max_size=256), st.binary(max_size=256)),
    st.builds(
        safetensors_like,
        st.sampled_from([b'{"input_ids":{"dtype":"I64","shape":[1,4],"data_offsets":[0,32]}}', b"{}", b"[]"]),
        st.binary(max_size=64),
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(route=st.sampled_from(BODY_ROUTES), body=bodies)
def test_random_bodies_get_a_json_4xx(server, route, body):
    method, path = route
    response = httpx.request(method, server.url + path, content=body)
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    assert set(response.json()["error"]) == {"type", "message"}


def requests_counted(url: str, route: str, code: str) -> float:
    return metric_samples(url).get(("eagle3_requests_total", (("code", code), ("route", route))), 0.0)


@pytest.mark.parametrize(
    ("method", "path", "route"),
    [
        ("POST", "/v1/supervision", "/v1/supervision"),
        ("PUT", "/v1/vocab-mappings/gone", "/v1/vocab-mappings/{mapping_id}"),
        ("POST", "/set_vocab_mapping", "/set_vocab_mapping"),
    ],
)
def test_a_client_gone_mid_upload_is_a_499_with_one_log_line(server, method, path, route):
    before = {code: requests_counted(server.url, route, code) for code in ("499", "500")}
    log_start = server.log_path.stat().st_size

    def lines_about_it() -> list[tuple[str, bool]]:
        text = server.log_path.read_bytes()[log_start:].decode(errors="replace")
        lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        return [(line["message"], "exception" in line) for line in lines if line.get("route") == route]

    with connect(server.url) as sock:  # leaves with 4,900 bytes of its body unsent
        sock.sendall(
            f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n".encode() + b"\0" * 100
        )
    assert eventually(lines_about_it, "the request's log line") == [(f"{method} {path} 499", False)]
    assert "Traceback" not in server.log_path.read_bytes()[log_start:].decode(errors="replace")
    assert requests_counted(server.url, route, "499") == before["499"] + 1
    assert requests_counted(server.url, route, "500") == before["500"]


def test_transfer_encoding_with_content_length_is_refused_by_the_parser(server):
    """Both headers: the parser refuses the request as ambiguous framing (a JSON 400), and nothing is sized
    by a Content-Length that Transfer-Encoding overrides (no 413)."""
    with connect(server.url) as sock:
        sock.sendall(
            b"POST /v1/supervision HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Length: 99999999999\r\n\r\n0\r\n\r\n"
        )
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, payload = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ")
    assert json.loads(payload)["error"]["type"] == "bad_request"
    assert_still_serving(server.url)


def test_server_still_serves_after_fuzzing(server):
    assert_still_serving(server.url)
