"""The error contract: every bad request gets its JSON 4xx, and the server keeps serving afterwards."""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
import time
from pathlib import Path

import httpx
import pytest
import torch
from eagle3_target.server.app import create_app
from eagle3_target.server.settings import ServerSettings
from eagle3_target.wire import tensors as tensor_wire

from support.server_process import MAX_BATCH_TOKENS, MAX_MODEL_LEN, connect, serve_in_thread
from support.supervision import VOCAB, assert_error, assert_still_serving, draft_mapping, put_mapping

TOKEN_BODY_LIMIT = ServerSettings(model="unused", max_batch_tokens=MAX_BATCH_TOKENS).token_body_limit


def ids(batch: int, seq: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1)).to(dtype)


def body(**tensors: torch.Tensor) -> bytes:
    return tensor_wire.encode(tensors)


def left_padded_mask() -> torch.Tensor:
    mask = torch.ones(2, 6, dtype=torch.int64)
    mask[1, 0] = 0
    return mask


def case(case_id: str, content: bytes, status: int = 422, type_: str = "invalid_input", **params: str):
    return pytest.param(params, content, status, type_, id=case_id)


GARBAGE = bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(7)).tolist())
TOO_MANY_ROWS = MAX_BATCH_TOKENS // MAX_MODEL_LEN + 1
SUPERVISION_CASES = [
    case("garbage", GARBAGE, 400, "bad_request"),
    case("empty-body", b"", 400, "bad_request"),
    case("header-overrun", struct.pack("<Q", 10**6) + b"{}", 400, "bad_request"),
    case("header-not-json", struct.pack("<Q", 4) + b"nope", 400, "bad_request"),
    case("float-ids", body(input_ids=ids(1, 4, torch.float32))),
    case("int16-ids", body(input_ids=ids(1, 4, torch.int16))),
    case("one-dim-ids", body(input_ids=ids(1, 4)[0])),
    case("token-id-at-vocab", body(input_ids=torch.full((1, 4), VOCAB))),
    case("negative-token-id", body(input_ids=torch.full((1, 4), -1))),
    case("empty-batch", body(input_ids=torch.zeros(0, 4, dtype=torch.int64))),
    case("empty-sequence", body(input_ids=torch.zeros(2, 0, dtype=torch.int64))),
    case("over-max-model-len", body(input_ids=ids(1, MAX_MODEL_LEN + 1))),
    case(
        "over-max-batch-tokens", body(input_ids=ids(TOO_MANY_ROWS, MAX_MODEL_LEN)), 413, "payload_too_large"
    ),
    case("missing-input-ids", body(attention_mask=torch.ones(1, 4, dtype=torch.int64))),
    case("unexpected-tensor", body(input_ids=ids(1, 4), extra=torch.ones(1))),
    case("mask-shape", body(input_ids=ids(2, 6), attention_mask=torch.ones(2, 5, dtype=torch.int64))),
    case("mask-values", body(input_ids=ids(2, 6), attention_mask=torch.full((2, 6), 2))),
    case("mask-float", body(input_ids=ids(2, 6), attention_mask=torch.ones(2, 6))),
    case("left-padded", body(input_ids=ids(2, 6), attention_mask=left_padded_mask())),
    case("unknown-format", body(input_ids=ids(1, 4)), format="everything"),
    case("unknown-dtype", body(input_ids=ids(1, 4)), format="logits", dtype="int8"),
    case("dtype-for-hidden", body(input_ids=ids(1, 4)), format="hidden", dtype="bfloat16"),
    case("probs-without-vocab", body(input_ids=ids(1, 4)), format="probs"),
    case(
        "unknown-vocab", body(input_ids=ids(1, 4)), 404, "not_found", format="draft", vocab="never-registered"
    ),
]


@pytest.mark.parametrize(("params", "content", "status", "type_"), SUPERVISION_CASES)
def test_bad_supervision_requests(server, params, content, status, type_):
    response = httpx.post(server.url + "/v1/supervision", params=params, content=content)
    assert_error(response, status, type_)
    assert_still_serving(server.url)


def test_declared_oversize_body_is_refused_before_reading(server):
    content = b"\0" * (TOKEN_BODY_LIMIT + 1)
    response = httpx.post(server.url + "/v1/supervision", content=content)
    message = assert_error(response, 413, "payload_too_large")["message"]
    assert "Content-Length" not in message
    assert f"of {len(content)} bytes" in message  # refused on the declared length, not while streaming
    assert_still_serving(server.url)


def test_streamed_oversize_body_is_cut_off(server):
    """No Content-Length (chunked): the streaming cap stops reading past the limit."""
    chunk = b"\0" * 16384
    chunks = TOKEN_BODY_LIMIT // len(chunk) + 2

    def stream():
        for _ in range(chunks):
            yield chunk

    response = httpx.post(server.url + "/v1/supervision", content=stream())
    assert "content-length" not in response.request.headers
    assert_error(response, 413, "payload_too_large")
    assert_still_serving(server.url)


def raw_exchange(url: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send bytes no HTTP client library would send; read the answer until the server closes."""
    with connect(url) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, payload = received.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), {k.lower(): v for k, v in headers.items()}, payload


@pytest.mark.parametrize("declared", ["abc", "-1", "12abc", "1e3"])
def test_invalid_content_length(server, declared):
    request = (
        f"POST /v1/supervision HTTP/1.1\r\nHost: localhost\r\nContent-Length: {declared}\r\n\r\nabc"
    ).encode()
    status, headers, payload = raw_exchange(server.url, request)
    assert status == 400
    assert headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(payload)
    error = json.loads(payload)["error"]
    assert error["type"] == "bad_request" and error["message"]
    assert_still_serving(server.url)


@pytest.mark.parametrize(
    ("mapping_id", "selected", "status"),
    [
        ("out-of-range", torch.tensor([0, VOCAB]), 422),
        ("negative", torch.tensor([-1, 3]), 422),
        ("duplicates", torch.tensor([4, 4, 5]), 422),
        ("empty", torch.zeros(0, dtype=torch.int64), 422),
        ("float-ids", torch.tensor([1.0, 2.0]), 422),
        ("two-dims", torch.tensor([[1, 2]]), 422),
        ("bad%20id", torch.tensor([1, 2]), 422),
    ],
)
def test_bad_vocab_mappings(server, mapping_id, selected, status):
    response = httpx.put(
        f"{server.url}/v1/vocab-mappings/{mapping_id}",
        content=tensor_wire.encode({"selected_token_ids": selected}),
    )
    assert_error(response, status, "invalid_input")
    # A rejected mapping is not stored.
    probe = httpx.post(
        server.url + "/v1/supervision",
        params={"format": "probs", "vocab": mapping_id},
        content=body(input_ids=ids(1, 4)),
    )
    assert probe.status_code in (404, 422)
    assert_still_serving(server.url)


def test_vocab_mapping_with_garbage_body(server):
    assert_error(
        httpx.put(server.url + "/v1/vocab-mappings/garbage", content=b"\x01\x02"), 400, "bad_request"
    )
    assert_error(
        httpx.put(
            server.url + "/v1/vocab-mappings/two",
            content=body(selected_token_ids=torch.tensor([1]), x=torch.ones(1)),
        ),
        422,
        "invalid_input",
    )
    assert_still_serving(server.url)


def test_unknown_routes_methods_and_weights_answer_json(server):
    assert_error(httpx.get(server.url + "/v2/nothing"), 404, "not_found")
    assert_error(httpx.get(server.url + "/v1/supervision"), 405, "method_not_allowed")
    assert_error(httpx.get(server.url + "/v1/weights/everything"), 404, "not_found")
    assert_still_serving(server.url)


def test_mapping_registered_after_a_404_works(server):
    """The client's recovery path: unknown vocab (404), PUT it, and the same request succeeds."""
    request = {"format": "draft", "vocab": "late-mapping"}
    assert_error(
        httpx.post(server.url + "/v1/supervision", params=request, content=body(input_ids=ids(1, 4))), 404
    )
    with httpx.Client() as client:
        assert put_mapping(client, server.url, "late-mapping", draft_mapping(32, seed=4)).status_code == 200
    ok = httpx.post(server.url + "/v1/supervision", params=request, content=body(input_ids=ids(1, 4)))
    assert ok.status_code == 200
    assert tensor_wire.decode(ok.content)[0]["draft_logits"].shape == (1, 4, 32)


class BuggyRunner:
    """The real runner with an internal bug: its forward raises a ValueError the client did not cause."""

    def __init__(self, runner: object) -> None:
        self._runner = runner

    def __getattr__(self, name: str) -> object:
        return getattr(self._runner, name)

    def forward_hidden(self, *_args: object, **_kwargs: object) -> None:
        raise ValueError("internal bug: tensors of mismatched shapes")


def test_an_internal_error_is_a_json_500_and_the_server_keeps_serving(
    server_model_dir: Path, caplog: pytest.LogCaptureFixture
):
    app = create_app(ServerSettings(model=str(server_model_dir), engine="hf", dtype="float32"))
    state = app.state.server
    with serve_in_thread(app) as url:
        deadline = time.monotonic() + 120
        while httpx.get(url + "/readyz").status_code != 200:
            assert time.monotonic() < deadline, state.load_error
            time.sleep(0.1)
        healthy = state.target
        state.target = dataclasses.replace(healthy, runner=BuggyRunner(healthy.runner))
        with caplog.at_level(logging.ERROR, logger="eagle3_target.server.errors"):
            response = httpx.post(url + "/v1/supervision", content=body(input_ids=ids(1, 4)))
        error = assert_error(response, 500, "internal_error")
        assert "internal bug" in error["message"]
        assert any(r.exc_info and "unhandled error" in r.getMessage() for r in caplog.records)
        state.target = healthy
        assert_still_serving(url)
