"""Answers streamed from the tensors' memory: the library's bytes, the per-response cap, probes while large
bodies stream to readers that do not read, and memory that stays flat across many large answers."""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Iterator

import httpx
import pytest
import safetensors.torch
import torch
from eagle3_target.contract import VocabMapping
from eagle3_target.protocol import FORMATS, WEIGHT_NAMES
from eagle3_target.tiny import write_tiny_model
from eagle3_target.wire import nemo as nemo_wire
from eagle3_target.wire import tensors as tensor_wire

from support.cluster.waiting import LOOPBACK
from support.server_process import ServerProcess, start_server
from support.supervision import assert_error, assert_still_serving, draft_mapping, metric_samples, put_mapping

# A wide vocabulary makes `logits` answers large: 16384 fp32 logits + 3 x 64 fp32 aux = 66,304 bytes/token.
WIDE_VOCAB = 16384
BYTES_PER_TOKEN = WIDE_VOCAB * 4 + 3 * 64 * 4
MAX_RESPONSE_BYTES = 40_000_000
FITS = 512  # tokens: a 34 MB answer
TOO_BIG = 1024  # tokens: 68 MB


@pytest.fixture(scope="module")
def wide_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("wide")
    model = write_tiny_model(directory / "model", vocab_size=WIDE_VOCAB)
    server = start_server(
        directory,
        [
            "--model", str(model), "--engine", "hf", "--dtype", "float32",
            "--max-model-len", "1024", "--max-batch-tokens", "4096",
            "--max-response-bytes", str(MAX_RESPONSE_BYTES),
        ],
    )  # fmt: skip
    yield server
    server.stop()


def ids(tokens: int, rows: int = 1) -> torch.Tensor:
    return torch.randint(
        0, WIDE_VOCAB, (rows, tokens // rows), generator=torch.Generator().manual_seed(tokens)
    )


def logits_request(tokens: int) -> bytes:
    body = tensor_wire.encode({"input_ids": ids(tokens)})
    head = (
        f"POST /v1/supervision?format=logits HTTP/1.1\r\nHost: {LOOPBACK}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def parts_of(body: bytes) -> tuple[int, dict, bytes]:
    """(header length, header, data) of a safetensors body."""
    (length,) = struct.unpack("<Q", body[:8])
    return length, json.loads(body[8 : 8 + length]), body[8 + length :]


def test_every_answer_is_byte_for_byte_the_safetensors_librarys_file(server):
    """Byte for byte but for the order of the metadata's keys, which the library itself does not fix (it
    keeps them in a hash map)."""
    with httpx.Client(base_url=server.url) as http:
        put_mapping(http, server.url, "stream", draft_mapping(64, seed=3)).raise_for_status()
        bodies = {
            fmt: http.post(
                "/v1/supervision",
                params={"format": fmt} | ({"vocab": "stream"} if meta.needs_vocab else {}),
                content=tensor_wire.encode({"input_ids": torch.arange(40).reshape(2, 20)}),
            )
            for fmt, meta in FORMATS.items()
        }
        bodies |= {name: http.get(f"/v1/weights/{name}") for name in WEIGHT_NAMES}
    for name, response in bodies.items():
        assert response.status_code == 200, (name, response.text)
        body = response.content
        assert int(response.headers["content-length"]) == len(body)
        length, header, data = parts_of(body)
        theirs = safetensors.torch.save(safetensors.torch.load(body), header["__metadata__"])
        their_length, their_header, their_data = parts_of(theirs)
        assert (their_length, their_header, their_data) == (length, header, data), name
        assert [key for key in their_header if key != "__metadata__"] == [
            key for key in header if key != "__metadata__"
        ], name


def test_an_answer_over_the_cap_is_413_before_the_engine_runs(wide_server):
    url = wide_server.url
    batches_before = metric_samples(url)[("eagle3_batch_tokens_count", ())]
    response = httpx.post(
        url + "/v1/supervision",
        params={"format": "logits"},
        content=tensor_wire.encode({"input_ids": ids(TOO_BIG, rows=2)}),
    )
    error = assert_error(response, 413, "payload_too_large")
    assert str(MAX_RESPONSE_BYTES) in error["message"] and "--max-response-bytes" in error["message"]
    details = response.json()
    assert details["max_response_bytes"] == MAX_RESPONSE_BYTES
    assert httpx.get(url + "/v1/info").json()["max_response_bytes"] == MAX_RESPONSE_BYTES
    assert details["response_bytes"] >= TOO_BIG * BYTES_PER_TOKEN > MAX_RESPONSE_BYTES
    assert metric_samples(url)[("eagle3_batch_tokens_count", ())] == batches_before  # nothing computed
    # The same tokens in a format that fits are served, and so is an answer just under the cap.
    hidden = httpx.post(url + "/v1/supervision", content=tensor_wire.encode({"input_ids": ids(TOO_BIG, 2)}))
    assert hidden.status_code == 200
    fits = httpx.post(
        url + "/v1/supervision",
        params={"format": "logits"},
        content=tensor_wire.encode({"input_ids": ids(FITS)}),
    )
    assert fits.status_code == 200 and FITS * BYTES_PER_TOKEN < len(fits.content) < MAX_RESPONSE_BYTES


def test_nemo_generate_over_the_cap_is_413(wide_server):
    url = wide_server.url
    # Every token in the draft vocabulary: NeMo's fp32 probabilities then weigh what full logits do.
    mapping = VocabMapping.from_selected_ids(torch.randperm(WIDE_VOCAB), WIDE_VOCAB)
    with httpx.Client(base_url=url) as nemo:  # one connection: NeMo binds its mapping to it
        registered = nemo.post(
            "/set_vocab_mapping",
            content=nemo_wire.encode(
                {
                    "selected_token_ids": mapping.selected_token_ids,
                    "selected_token_mask": mapping.selected_token_mask,
                }
            ),
        )
        assert registered.status_code == 200, registered.text
        tokens = ids(TOO_BIG, rows=2)
        body = {
            "input_ids": tokens,
            "attention_mask": torch.ones_like(tokens),
            "loss_mask": torch.ones_like(tokens),
        }
        assert_error(nemo.post("/generate", content=nemo_wire.encode(body)), 413, "payload_too_large")
        small = {name: t[:1, :64] for name, t in body.items()}
        assert nemo.post("/generate", content=nemo_wire.encode(small)).status_code == 200


def test_probes_answer_while_large_answers_wait_for_readers_that_do_not_read(wide_server):
    url = wide_server.url
    stalled = []
    for _ in range(3):
        sock = socket.create_connection((LOOPBACK, int(url.rsplit(":", 1)[1])))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(logits_request(FITS))
        stalled.append(sock)
    try:
        time.sleep(2)  # the answers are computed and stuck in flow control now
        for path in ("/readyz", "/healthz", "/metrics", "/v1/info"):
            started = time.monotonic()
            assert httpx.get(url + path, timeout=5).status_code == 200, path
            assert time.monotonic() - started < 1.0, path  # Kubernetes' default probe timeout
        assert_still_serving(url)
    finally:
        for sock in stalled:
            sock.close()
    assert_still_serving(url)


def test_memory_stays_flat_across_twenty_large_answers(wide_server):
    url = wide_server.url
    body = tensor_wire.encode({"input_ids": ids(FITS)})
    answer_mib = FITS * BYTES_PER_TOKEN / 2**20
    with httpx.Client(base_url=url, timeout=120) as http:

        def pull() -> None:
            response = http.post("/v1/supervision", params={"format": "logits"}, content=body)
            assert response.status_code == 200 and len(response.content) > FITS * BYTES_PER_TOKEN

        for _ in range(2):  # allocator and page-cache warm-up
            pull()
        settled = wide_server.memory_mib()["VmRSS"]
        for _ in range(20):
            pull()
        grown = wide_server.memory_mib()["VmRSS"] - settled
    assert grown < answer_mib, f"RSS grew {grown:.0f} MiB over 20 answers of {answer_mib:.0f} MiB"
