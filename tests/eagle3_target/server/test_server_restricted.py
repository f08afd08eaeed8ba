"""A server configured by EAGLE3_TARGET_* env alone: bearer auth and a queue of one; and one whose model
cannot load (run in this process under uvicorn), which stays alive but not ready."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from eagle3_target.server.app import create_app
from eagle3_target.server.settings import ServerSettings
from eagle3_target.wire import tensors as tensor_wire

from support.server_process import AUTH_TOKEN, serve_in_thread
from support.supervision import assert_error, metric_samples, token_batch

AUTH = {"Authorization": f"Bearer {AUTH_TOKEN}"}


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/v1/info", "/metrics"])
def test_probes_identity_and_metrics_need_no_token(restricted_server, path):
    """The operator probes /readyz and /v1/info with no credentials: they reveal the model, never tensors."""
    assert httpx.get(restricted_server.url + path).status_code == 200


def test_metrics_port_serves_only_the_metrics(restricted_server):
    """EAGLE3_TARGET_METRICS_PORT: the same registry on a port a network policy can open to Prometheus."""
    scraped = httpx.get(restricted_server.metrics_url + "/metrics")
    assert scraped.status_code == 200
    assert "eagle3_requests_total" in scraped.text
    assert "eagle3_model_info" in scraped.text
    # Any path there is the exposition; no data route is reachable through it.
    other = httpx.get(restricted_server.metrics_url + "/v1/info", headers=AUTH)
    assert other.headers["content-type"].startswith("text/plain")
    assert "eagle3_requests_total" in other.text


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": AUTH_TOKEN},
        {"Authorization": f"Basic {AUTH_TOKEN}"},
    ],
    ids=["missing", "wrong", "no-scheme", "basic"],
)
def test_routes_need_the_bearer_token(restricted_server, headers):
    for method, path in [
        ("POST", "/v1/supervision"),
        ("PUT", "/v1/vocab-mappings/draft"),
        ("GET", "/v1/weights/lm_head"),
        ("GET", "/health"),
        ("POST", "/generate"),
    ]:
        response = httpx.request(method, restricted_server.url + path, headers=headers)
        assert_error(response, 401, "unauthorized")
        assert response.headers["www-authenticate"] == "Bearer"


def test_token_opens_routes_and_env_configures_the_server(restricted_server):
    info = httpx.get(restricted_server.url + "/v1/info", headers=AUTH)
    assert info.status_code == 200
    assert info.json()["aux_layer_ids"] == [0, 2, 5]  # EAGLE3_TARGET_AUX_LAYER_IDS
    assert info.json()["max_batch_tokens"] == 65536
    ids, mask, _ = token_batch(2, 1, 8)
    response = httpx.post(
        restricted_server.url + "/v1/supervision",
        headers=AUTH,
        content=tensor_wire.encode({"input_ids": ids, "attention_mask": mask}),
    )
    assert response.status_code == 200
    assert tensor_wire.decode(response.content)[0]["aux_hidden_states"].shape == (1, 8, 3 * 64)


def test_full_queue_answers_429_with_retry_after(restricted_server):
    """A long request occupies the engine; with --max-queue 1 one more may wait, the rest get 429."""
    url = restricted_server.url
    big_ids = torch.randint(0, 256, (8, 1024), generator=torch.Generator().manual_seed(3))
    big_body = tensor_wire.encode({"input_ids": big_ids})
    big_result: dict[str, httpx.Response] = {}

    def send_big() -> None:
        big_result["response"] = httpx.post(
            url + "/v1/supervision", params={"format": "logits"}, headers=AUTH, content=big_body, timeout=300
        )

    batches_before = metric_samples(url)[("eagle3_batch_tokens_sum", ())]
    sender = threading.Thread(target=send_big)
    sender.start()
    deadline = time.monotonic() + 120
    # The worker records a batch's tokens as it starts running it: then the engine is busy for seconds.
    while metric_samples(url)[("eagle3_batch_tokens_sum", ())] < batches_before + big_ids.numel():
        assert time.monotonic() < deadline, "the long request never reached the engine"
        time.sleep(0.05)
    small = [token_batch(i, 1, 4 + i)[0] for i in range(4)]
    responses: list[httpx.Response | None] = [None] * len(small)
    start = threading.Barrier(len(small))

    def send_small(i: int) -> None:
        body = tensor_wire.encode({"input_ids": small[i]})
        start.wait()
        responses[i] = httpx.post(url + "/v1/supervision", headers=AUTH, content=body, timeout=300)

    senders = [threading.Thread(target=send_small, args=(i,)) for i in range(len(small))]
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join()
    sender.join()
    codes = sorted(r.status_code for r in responses)
    # One small request may wait in the queue; the others find it full while the engine is busy.
    assert codes.count(429) >= len(small) - 1 and set(codes) <= {200, 429}, codes
    rejected = [r for r in responses if r.status_code == 429]
    for response in rejected:
        assert_error(response, 429, "queue_full")
        assert int(response.headers["retry-after"]) >= 1
    assert big_result["response"].status_code == 200
    assert tensor_wire.decode(big_result["response"].content)[0]["logits"].shape == (8, 1024, 256)
    assert (
        metric_samples(url)[("eagle3_requests_total", (("code", "429"), ("route", "/v1/supervision")))] >= 1
    )
    ok = httpx.post(
        url + "/v1/supervision", headers=AUTH, content=tensor_wire.encode({"input_ids": small[0]})
    )
    assert ok.status_code == 200


def test_an_embedded_server_whose_load_failed_answers_503_with_the_reason(tmp_path: Path):
    empty_model = tmp_path / "no-model"
    empty_model.mkdir()
    app = create_app(ServerSettings(model=str(empty_model), engine="hf"))
    with serve_in_thread(app) as url:
        deadline = time.monotonic() + 60
        while "failed" not in httpx.get(url + "/readyz").json()["error"]["message"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        error = assert_error(httpx.get(url + "/readyz"), 503, "not_ready")
        assert "config.json" in error["message"]
        loading = httpx.get(url + "/readyz").json()["loading"]
        assert (
            loading["phase"] == "failed" and error["message"] == f"model failed to load: {loading['message']}"
        )
        assert httpx.get(url + "/healthz").status_code == 200
        assert_error(httpx.get(url + "/v1/info"), 503, "not_ready")
        assert_error(httpx.post(url + "/v1/supervision", content=b"x"), 503, "not_ready")
        assert_error(httpx.get(url + "/health"), 503, "not_ready")
        assert metric_samples(url)[("eagle3_ready", ())] == 0
