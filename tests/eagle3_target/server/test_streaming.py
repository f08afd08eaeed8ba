"""Answers streamed from the tensors' memory: the library's bytes, the per-response cap, probes while large
bodies stream to readers that do not read, memory that stays flat across many large answers, and answers
nobody reads: aborted after the send timeout with their memory freed, and capped in bytes while they wait."""

from __future__ import annotations

import http.client
import json
import struct
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import safetensors.torch
import torch
from eagle3_target.contract import VocabMapping
from eagle3_target.protocol import FORMATS, WEIGHT_NAMES
from eagle3_target.server.metrics import ServerMetrics
from eagle3_target.server.refusals import AnswerMemoryFull, TooLarge
from eagle3_target.server.streaming import AnswerMemory
from eagle3_target.tiny import write_tiny_model
from eagle3_target.wire import nemo as nemo_wire
from eagle3_target.wire import tensors as tensor_wire

from support.cluster.waiting import eventually
from support.server_process import ServerProcess, connect, start_server
from support.supervision import (
    assert_error,
    assert_still_serving,
    bytes_per_token,
    draft_mapping,
    in_flight,
    logits_request,
    metric_samples,
    put_mapping,
    stalled_reader,
)

# A wide vocabulary makes `logits` answers large: 16384 fp32 logits + 3 x 64 fp32 aux = 66,304 bytes/token.
WIDE_VOCAB = 16384
HIDDEN = 64
BYTES_PER_TOKEN = bytes_per_token("logits", hidden=HIDDEN, vocab=WIDE_VOCAB)
MAX_RESPONSE_BYTES = 40_000_000
FITS = 512  # tokens: a 34 MB answer
TOO_BIG = 1024  # tokens: 68 MB
SEND_TIMEOUT = 6.0  # long enough that stalled answers are all still held while a slow machine checks them
STALLED = 12
STALLED_TOKENS = 256  # a 17 MB (16.2 MiB) answer
# Room for the stalled answers and half of another, so one more is refused while they are held.
IN_FLIGHT_CAP = int((STALLED + 0.5) * STALLED_TOKENS * BYTES_PER_TOKEN)


@pytest.fixture(scope="module")
def wide_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("wide")
    model = write_tiny_model(directory / "model", hidden_size=HIDDEN, vocab_size=WIDE_VOCAB)
    server = start_server(
        directory,
        [
            "--model", str(model), "--engine", "hf", "--dtype", "float32",
            "--max-model-len", "1024", "--max-batch-tokens", "4096",
            "--max-response-bytes", str(MAX_RESPONSE_BYTES),
            "--response-send-timeout", str(SEND_TIMEOUT),
            "--max-response-bytes-in-flight", str(IN_FLIGHT_CAP),
        ],
    )  # fmt: skip
    yield server
    server.stop()


def ids(tokens: int, rows: int = 1) -> torch.Tensor:
    return torch.randint(
        0, WIDE_VOCAB, (rows, tokens // rows), generator=torch.Generator().manual_seed(tokens)
    )


def gauge(url: str, name: str) -> float:
    return metric_samples(url)[(name, ())]


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
    computed = gauge(url, "eagle3_batch_tokens_sum")
    stalled = [stalled_reader(url, ids(FITS)) for _ in range(3)]
    try:
        eventually(lambda: gauge(url, "eagle3_batch_tokens_sum") == computed + 3 * FITS, "answers computed")
        assert in_flight(url) == 3  # and stuck in flow control
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


def test_answers_nobody_reads_are_aborted_after_the_send_timeout_and_their_memory_freed(wide_server):
    url = wide_server.url
    answer_mib = STALLED_TOKENS * BYTES_PER_TOKEN / 2**20
    body = tensor_wire.encode({"input_ids": ids(STALLED_TOKENS)})

    def pull(_: int) -> int:
        return httpx.post(
            url + "/v1/supervision", params={"format": "logits"}, content=body, timeout=60
        ).status_code

    with ThreadPoolExecutor(STALLED) as clients:  # warm-up: the same answers, read (the same batches)
        for _ in range(2):
            assert set(clients.map(pull, range(STALLED))) == {200}
    computed = gauge(url, "eagle3_batch_tokens_sum")
    aborted = gauge(url, "eagle3_send_timeouts_total")
    before = wide_server.memory_mib()["VmRSS"]
    stalled = [stalled_reader(url, ids(STALLED_TOKENS)) for _ in range(STALLED)]
    try:
        eventually(
            lambda: gauge(url, "eagle3_batch_tokens_sum") == computed + STALLED * STALLED_TOKENS,
            "every stalled answer to be computed",
        )
        assert in_flight(url) == STALLED
        peak = [0.0]

        def aborted_all() -> bool:
            peak[0] = max(peak[0], wide_server.memory_mib()["VmRSS"] - before)
            return in_flight(url) == 0

        eventually(aborted_all, "the stalled answers to be aborted", timeout=8 * SEND_TIMEOUT)
        assert gauge(url, "eagle3_send_timeouts_total") == aborted + STALLED
        assert gauge(url, "eagle3_answer_bytes_in_flight") == 0
        after = wide_server.memory_mib()["VmRSS"] - before
    finally:
        for sock in stalled:
            sock.close()
    grown = f"RSS over {before:.0f} MiB: +{peak[0]:.0f} MiB while held, +{after:.0f} MiB after the timeout"
    assert after < STALLED * answer_mib / 4, grown
    assert "no byte of its answer taken" in wide_server.log()
    assert_still_serving(url)


def test_a_reader_that_pauses_shorter_than_the_send_timeout_gets_its_whole_answer(wide_server):
    """Progress, however intermittent, is not a stall: only a client that takes nothing for the timeout is
    cut off, however long the whole answer takes."""
    with connect(wide_server.url) as sock:
        sock.sendall(logits_request(ids(STALLED_TOKENS)))
        answer = http.client.HTTPResponse(sock)
        time.sleep(SEND_TIMEOUT / 2)  # six pauses of half the timeout: three times the timeout in all
        answer.begin()
        assert answer.status == 200
        size = int(answer.headers["content-length"])
        payload = bytearray()
        for _ in range(5):
            part = answer.read(size // 6)  # a short read: the server cut the answer off
            payload += part
            assert len(part) == size // 6, f"cut off after {len(payload)} of {size} bytes"
            time.sleep(SEND_TIMEOUT / 2)
        payload += answer.read()  # IncompleteRead if cut off
    assert len(payload) == size
    tensors, _ = tensor_wire.decode(payload)
    assert tensors["logits"].shape == (1, STALLED_TOKENS, WIDE_VOCAB)


def test_answers_beyond_the_bytes_in_flight_get_503_until_the_held_ones_go(wide_server):
    url = wide_server.url
    refused = gauge(url, "eagle3_answer_memory_refusals_total")
    computed = gauge(url, "eagle3_batch_tokens_sum")
    stalled = [stalled_reader(url, ids(STALLED_TOKENS)) for _ in range(STALLED)]
    try:
        eventually(
            lambda: gauge(url, "eagle3_batch_tokens_sum") == computed + STALLED * STALLED_TOKENS,
            "every stalled answer to be computed",
        )
        one_more = tensor_wire.encode({"input_ids": ids(STALLED_TOKENS)})
        response = httpx.post(url + "/v1/supervision", params={"format": "logits"}, content=one_more)
        error = assert_error(response, 503, "answer_memory_full")
        assert "--max-response-bytes-in-flight" in error["message"]
        assert response.headers["retry-after"] == "1"
        assert response.json()["limit_bytes"] == IN_FLIGHT_CAP
        assert gauge(url, "eagle3_answer_memory_refusals_total") == refused + 1
        assert gauge(url, "eagle3_batch_tokens_sum") == computed + STALLED * STALLED_TOKENS  # not computed
        small = httpx.post(url + "/v1/supervision", content=tensor_wire.encode({"input_ids": ids(16)}))
        assert small.status_code == 200  # a small answer still fits beside them
        eventually(lambda: in_flight(url) == 0, "the stalled answers to be aborted", timeout=8 * SEND_TIMEOUT)
        response = httpx.post(url + "/v1/supervision", params={"format": "logits"}, content=one_more)
        assert response.status_code == 200
    finally:
        for sock in stalled:
            sock.close()


def test_a_lone_answer_always_fits_and_every_hold_is_given_back():
    """An answer the per-request cap accepts is never refused for good: alone, it goes over the cap on
    answers in flight; one over the per-request cap is 413 and holds nothing."""
    memory = AnswerMemory(answer_limit=150, in_flight_limit=100, metrics=ServerMetrics())
    with memory.request() as oversized:
        with pytest.raises(TooLarge):
            oversized.take_answer(151, tokens=1)
        assert memory.held == 0
    with memory.request() as big:
        big.take_answer(150, tokens=1)
        with pytest.raises(AnswerMemoryFull), memory.request() as other:
            other.take(1)
        assert memory.held == 150
    with pytest.raises(RuntimeError), memory.request() as failing:  # a request that fails gives back too
        failing.take(60)
        raise RuntimeError("the engine failed")
    with memory.request() as first, memory.request() as second:
        first.take(60)
        second.take(40)
        assert (
            memory.held == 100
            and memory.metrics.registry.get_sample_value("eagle3_answer_bytes_in_flight") == 100
        )
    assert memory.held == 0
    assert memory.metrics.registry.get_sample_value("eagle3_answer_memory_refusals_total") == 1
