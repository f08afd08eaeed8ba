"""Random bodies on every route that reads one: always a JSON 4xx, never a 5xx, and the server lives on."""

from __future__ import annotations

import struct

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.supervision import assert_still_serving

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


def test_server_still_serves_after_fuzzing(server):
    assert_still_serving(server.url)
