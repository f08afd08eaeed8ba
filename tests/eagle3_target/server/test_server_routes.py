"""Every native route of a real ``eagle3-target serve`` process, compared with the in-process runner."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch
from eagle3_target.server.fingerprint import model_fingerprint
from eagle3_target.server.settings import ServerSettings
from eagle3_target.wire import tensors as tensor_wire

from support.server_process import MAX_BATCH_TOKENS, MAX_MODEL_LEN
from support.supervision import (
    assert_same_tensors,
    draft_mapping,
    metric_samples,
    put_mapping,
    reference,
    supervise,
    token_batch,
)


def test_probes_and_info(server, server_model_dir, reference_runner):
    assert httpx.get(server.url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(server.url + "/readyz").json()
    assert ready["status"] == "ready" and set(ready["activity"]) == {
        "requests",
        "idleSeconds",
        "inFlight",
        "activeClients",
        "clients",
    }
    info = httpx.get(server.url + "/v1/info").json()
    config = reference_runner.model.config
    assert info["model"] == "tiny-llama"
    assert info["revision"] == "r1"
    assert info["engine"] == "hf"
    assert info["dtype"] == "float32"
    assert (info["num_hidden_layers"], info["hidden_size"], info["vocab_size"]) == (
        config.num_hidden_layers,
        config.hidden_size,
        config.vocab_size,
    )
    assert info["aux_layer_ids"] == reference_runner.capture_layer_ids == [1, 3, 4]
    assert info["capture_layer_ids"] == [7, 1, 3, 0, 4]  # as given, in that order
    assert info["formats"] == ["hidden", "draft", "probs", "logits", "hidden_prenorm", "layers"]
    assert info["max_batch_tokens"] == MAX_BATCH_TOKENS
    assert info["max_response_bytes"] == ServerSettings(model="m").response_byte_limit  # the default here
    assert info["max_model_len"] == MAX_MODEL_LEN
    assert info["fingerprint"] == model_fingerprint(
        str(server_model_dir),
        model_name="tiny-llama",
        revision="r1",
        dtype="float32",
        engine="hf",
        aux_layer_ids=[1, 3, 4],
        capture_layer_ids=[7, 1, 3, 0, 4],
    )


def test_request_id_is_echoed_or_generated(server):
    echoed = httpx.get(server.url + "/healthz", headers={"X-Request-ID": "trace-123"})
    assert echoed.headers["x-request-id"] == "trace-123"
    generated = httpx.get(server.url + "/healthz", headers={"X-Request-ID": "bad id\twith spaces"})
    assert generated.headers["x-request-id"] not in ("", "bad id\twith spaces")
    # The access log is JSON lines carrying the request id (written just after the response is sent).
    access = wait_for_log_entry(server, "trace-123")
    assert access["route"] == "/healthz" and access["status"] == 200 and access["level"] == "INFO"
    assert wait_for_log_entry(server, generated.headers["x-request-id"])["route"] == "/healthz"


def wait_for_log_entry(server, request_id: str) -> dict:
    deadline = time.monotonic() + 10
    while True:
        entries = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
        matching = [e for e in entries if e.get("request_id") == request_id]
        if matching:
            return matching[-1]
        assert time.monotonic() < deadline, f"no log entry with request_id {request_id}"
        time.sleep(0.1)


@pytest.mark.parametrize("fmt", ["hidden", "draft", "probs", "logits", "hidden_prenorm"])
def test_every_format_matches_in_process_runner(server, reference_runner, fmt):
    mapping = draft_mapping(96, seed=11)
    ids, mask, _ = token_batch(5, 2, 24, pad_last=7)
    with httpx.Client() as client:
        assert put_mapping(client, server.url, "fmt-test", mapping).status_code == 200
        params = {"format": fmt} | ({"vocab": "fmt-test"} if fmt in ("draft", "probs") else {})
        got, metadata = supervise(client, server.url, {"input_ids": ids, "attention_mask": mask}, **params)
    uses_mapping = fmt in ("draft", "probs")
    assert_same_tensors(got, reference(reference_runner, fmt, ids, mask, mapping if uses_mapping else None))
    info = httpx.get(server.url + "/v1/info").json()
    assert metadata["format"] == fmt
    assert metadata["fingerprint"] == info["fingerprint"]
    assert json.loads(metadata["aux_layer_ids"]) == info["aux_layer_ids"]


def test_default_format_is_hidden_and_mask_is_optional(server, reference_runner):
    ids, _, _ = token_batch(6, 1, 9)
    with httpx.Client() as client:
        got, metadata = supervise(client, server.url, {"input_ids": ids.to(torch.int32)})
    assert metadata["format"] == "hidden"
    assert_same_tensors(got, reference(reference_runner, "hidden", ids, torch.ones_like(ids)))


def test_logits_in_bfloat16(server, reference_runner):
    ids, mask, _ = token_batch(8, 2, 12)
    with httpx.Client() as client:
        got, _ = supervise(
            client, server.url, {"input_ids": ids, "attention_mask": mask}, format="logits", dtype="bfloat16"
        )
    assert got["logits"].dtype == torch.bfloat16
    assert_same_tensors(got, reference(reference_runner, "logits", ids, mask, logits_dtype=torch.bfloat16))


def test_vocab_mappings_are_kept_per_id(server, reference_runner):
    first, second = draft_mapping(40, seed=1), draft_mapping(70, seed=2)
    ids, mask, _ = token_batch(9, 1, 16)
    with httpx.Client() as client:
        answer = put_mapping(client, server.url, "per-id-a", first)
        assert answer.json() == {"id": "per-id-a", "draft_vocab_size": 40, "digest": first.digest()}
        assert put_mapping(client, server.url, "per-id-b", second).status_code == 200
        got_a, meta_a = supervise(
            client, server.url, {"input_ids": ids, "attention_mask": mask}, format="probs", vocab="per-id-a"
        )
        got_b, _ = supervise(
            client, server.url, {"input_ids": ids, "attention_mask": mask}, format="probs", vocab="per-id-b"
        )
        # Re-putting an id replaces that id only.
        assert put_mapping(client, server.url, "per-id-a", second).status_code == 200
        got_a2, _ = supervise(
            client, server.url, {"input_ids": ids, "attention_mask": mask}, format="probs", vocab="per-id-a"
        )
    assert meta_a["vocab"] == "per-id-a"
    assert_same_tensors(got_a, reference(reference_runner, "probs", ids, mask, first))
    assert_same_tensors(got_b, reference(reference_runner, "probs", ids, mask, second))
    assert_same_tensors(got_a2, reference(reference_runner, "probs", ids, mask, second))


@pytest.mark.parametrize("name", ["input_embeddings", "lm_head", "final_norm"])
def test_weights(server, reference_runner, name):
    response = httpx.get(f"{server.url}/v1/weights/{name}")
    assert response.status_code == 200
    tensors, metadata = tensor_wire.decode(response.content)
    want = {
        "input_embeddings": reference_runner.input_embedding_weight,
        "lm_head": reference_runner.lm_head_weight,
        "final_norm": reference_runner.final_norm_weight,
    }[name]()
    assert list(tensors) == ["weight"]
    assert torch.equal(tensors["weight"], want)
    assert metadata["fingerprint"] == httpx.get(server.url + "/v1/info").json()["fingerprint"]


def test_concurrent_clients_each_get_their_own_rows(server, reference_runner):
    """16 clients at once, same shape so the worker may coalesce them: each answer is its own batch's."""
    clients = 16
    batches = [token_batch(100 + i, 2, 20) for i in range(clients)]
    results: list[dict | None] = [None] * clients
    start = threading.Barrier(clients)

    def run(i: int) -> None:
        ids, mask, _ = batches[i]
        with httpx.Client(timeout=120) as client:
            start.wait()
            results[i], _ = supervise(
                client, server.url, {"input_ids": ids, "attention_mask": mask}, format="logits"
            )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wants = [reference(reference_runner, "logits", ids, mask) for ids, mask, _ in batches]
    for i, want in enumerate(wants):
        got = results[i]
        assert got is not None
        # Coalesced batches run a larger GEMM, which may move a float by an ulp; another client's rows
        # would be off by whole units.
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)
        others = [other for j, other in enumerate(wants) if j != i]
        assert not any(torch.allclose(got["logits"], other["logits"], atol=1e-2) for other in others)


def test_metrics_parse_and_move(server):
    before = metric_samples(server.url)
    ids, mask, _ = token_batch(21, 3, 10)
    with httpx.Client() as client:
        response = client.post(
            server.url + "/v1/supervision",
            content=tensor_wire.encode({"input_ids": ids, "attention_mask": mask}),
        )
    assert response.status_code == 200
    after = metric_samples(server.url)
    requests_key = ("eagle3_requests_total", (("code", "200"), ("route", "/v1/supervision")))
    assert after[requests_key] == before.get(requests_key, 0) + 1
    assert after[("eagle3_tokens_total", ())] == before[("eagle3_tokens_total", ())] + 30
    bytes_key = ("eagle3_response_bytes_total", (("format", "hidden"), ("transport", "http")))
    assert after[bytes_key] == before.get(bytes_key, 0) + len(response.content)
    count_key = ("eagle3_request_duration_seconds_count", (("route", "/v1/supervision"),))
    assert after[count_key] == before.get(count_key, 0) + 1
    assert after[("eagle3_batch_tokens_count", ())] >= before[("eagle3_batch_tokens_count", ())] + 1
    assert after[("eagle3_ready", ())] == 1
    assert after[("eagle3_queue_depth", ())] == 0
    assert after[("eagle3_inflight_requests", ())] == 1  # the /metrics scrape itself
    info_samples = [labels for (name, labels) in after if name == "eagle3_model_info"]
    assert len(info_samples) == 1
    labels = dict(info_samples[0])
    assert labels["fingerprint"] == httpx.get(server.url + "/v1/info").json()["fingerprint"]
    assert labels["engine"] == "hf"
