"""TargetClient against real target servers on loopback, compared with the in-process HF backend."""

from __future__ import annotations

import dataclasses
import threading
import time

import httpx
import pytest
import torch
from eagle3_target.client import FingerprintChanged, RequestRejected, TargetClient, TargetUnavailable
from eagle3_target.contract import Eagle3TargetBatch, VocabMapping, build_batch
from eagle3_target.runners.hf import HFRunner
from eagle3_target.wire.tensors import encode
from prometheus_client.parser import text_string_to_metric_families

from support.cluster.waiting import eventually, free_port
from support.server_process import AUTH_TOKEN, serve_in_thread
from support.supervision import TokenBatch, draft_mapping, token_batch
from support.targets import create_target, target_status, wake_annotation, write_status

FAST_RETRIES = {"backoff_initial_s": 0.05, "backoff_max_s": 0.2}


def reference(runner, seed: int, mapping: VocabMapping | None = None) -> Eagle3TargetBatch:
    input_ids, attention_mask, loss_mask = token_batch(seed, pad_last=3)
    logits, aux = runner.forward_eagle3(input_ids, attention_mask)
    return build_batch(logits, aux, input_ids, attention_mask, loss_mask, mapping)


def assert_identical(got: Eagle3TargetBatch, expected: Eagle3TargetBatch) -> None:
    for field in dataclasses.fields(Eagle3TargetBatch):
        a, e = getattr(got, field.name), getattr(expected, field.name)
        if e is None:
            assert a is None, field.name
            continue
        assert a.dtype == e.dtype and a.shape == e.shape, (field.name, a.dtype, e.dtype, a.shape, e.shape)
        assert torch.equal(a, e), f"{field.name} differs by {(a.double() - e.double()).abs().max()}"


@pytest.mark.parametrize(
    ("fmt", "with_mapping"),
    [
        ("hidden", False),
        ("hidden", True),
        ("logits", False),
        ("logits", True),
        ("draft", True),
        ("probs", True),
    ],
)
def test_batch_equals_in_process_hf_batch(llama_server, llama_runner, fmt, with_mapping):
    mapping = draft_mapping(96, seed=7) if with_mapping else None
    expected = reference(llama_runner, seed=1, mapping=mapping)
    with TargetClient(llama_server.url, token=AUTH_TOKEN) as client:
        got = client.batch(*token_batch(1, pad_last=3), format=fmt, mapping=mapping)
    assert_identical(got, expected)
    if mapping is not None:
        assert expected.position_mask.any() and not expected.position_mask.all()  # the mask is exercised


def test_batch_of_a_bfloat16_target_equals_in_process_hf_batch_dtypes_included(spawn_server, tiny_llama_dir):
    server = spawn_server(tiny_llama_dir, "--dtype", "bfloat16")
    runner = HFRunner.from_pretrained(tiny_llama_dir, dtype="bfloat16", device="cpu")
    with TargetClient(server.url) as client:
        for fmt, mapping in [
            ("hidden", None),
            ("logits", None),
            ("draft", draft_mapping(96, seed=7)),
            ("probs", draft_mapping(96, seed=7)),
        ]:
            expected = reference(runner, seed=8, mapping=mapping)
            assert expected.aux_hidden_states.dtype == torch.bfloat16
            assert_identical(client.batch(*token_batch(8, pad_last=3), format=fmt, mapping=mapping), expected)


@pytest.mark.parametrize("fmt", ["hidden", "hidden_prenorm"])
def test_supervise_gives_the_in_process_runners_unshifted_hidden_states(llama_server, llama_runner, fmt):
    input_ids, attention_mask, _ = token_batch(3, pad_last=3)
    prenorm = fmt == "hidden_prenorm"
    final, aux = llama_runner.forward_hidden(input_ids, attention_mask, prenorm=prenorm)
    with TargetClient(llama_server.url, token=AUTH_TOKEN) as client:
        got = client.supervise(input_ids, attention_mask, format=fmt)
    last = "final_hidden_prenorm" if prenorm else "final_hidden"
    assert sorted(got) == sorted(["aux_hidden_states", last])
    assert torch.equal(got["aux_hidden_states"], aux) and torch.equal(got[last], final)


def test_formats_that_need_a_vocab_refuse_to_run_without_one(llama_server):
    with (
        TargetClient(llama_server.url, token=AUTH_TOKEN) as client,
        pytest.raises(ValueError, match="draft vocabulary"),
    ):
        client.supervise(token_batch(1, pad_last=3)[0], format="probs")


def test_as_target_runner_gives_nemos_runner_surface(llama_server, llama_runner):
    input_ids, attention_mask, _ = token_batch(2, pad_last=3)
    with TargetClient(llama_server.url, token=AUTH_TOKEN) as client:
        runner = client.as_target_runner()
        config = runner.model.config
        assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (8, 64, 256)
        assert next(runner.model.parameters()).device == torch.device("cpu")
        runner.set_aux_layers([1, 3, 4])
        with pytest.raises(ValueError, match=r"captures aux layers \[1, 3, 4\]"):
            runner.set_aux_layers([0, 2, 5])
        logits, aux = runner.forward_eagle3(input_ids, attention_mask)
        expected_logits, expected_aux = llama_runner.forward_eagle3(input_ids, attention_mask)
        assert torch.equal(logits, expected_logits)
        assert torch.equal(aux, expected_aux)
        assert torch.equal(runner.input_embedding_weight(), llama_runner.input_embedding_weight())


def test_bad_input_is_rejected_once_and_the_server_keeps_serving(llama_server, llama_runner):
    with TargetClient(llama_server.url, token=AUTH_TOKEN) as client:
        with pytest.raises(RequestRejected) as rejected:
            client.supervise(torch.tensor([[1, 2, 9999]]))
        assert rejected.value.status_code == 422
        assert "9999" in rejected.value.message or "range" in rejected.value.message
        assert client.stats["requests"] == 1  # a 4xx is not retried
        assert_identical(client.batch(*token_batch(3, pad_last=3)), reference(llama_runner, seed=3))


def test_unreachable_target_gives_up_with_the_last_error():
    url = f"http://127.0.0.1:{free_port()}"
    with (
        TargetClient(url, max_attempts=3, **FAST_RETRIES) as client,
        pytest.raises(TargetUnavailable, match=url),
    ):
        client.info()
    assert client.stats["connection_errors"] == 3


def test_by_default_the_client_retries_until_its_time_budget_is_spent():
    """No fixed attempt count cuts a replica's restart short: only give_up_after_s ends the retries."""
    url = f"http://127.0.0.1:{free_port()}"
    with (
        TargetClient(url, give_up_after_s=3, **FAST_RETRIES) as client,
        pytest.raises(TargetUnavailable, match=url),
    ):
        client.info()
    assert client.stats["connection_errors"] > 10  # back-off is at most 0.2 s here: 3 s allow ~15 tries


def test_a_server_killed_mid_run_loses_and_duplicates_no_batch(
    llama_server, llama_runner, spawn_server, tiny_llama_dir
):
    doomed = spawn_server(tiny_llama_dir)
    seeds = list(range(10, 22))
    expected = [reference(llama_runner, seed) for seed in seeds]
    delivered: list[Eagle3TargetBatch] = []
    with TargetClient([llama_server.url, doomed.url], token=AUTH_TOKEN, **FAST_RETRIES) as client:
        for batch in client.prefetch((token_batch(seed, pad_last=3) for seed in seeds), depth=3):
            delivered.append(batch)
            if len(delivered) == 3:
                doomed.process.kill()
                doomed.process.wait()
        assert client.stats["connection_errors"] >= 1
    assert len(delivered) == len(seeds)
    for got, want in zip(delivered, expected, strict=True):
        # Concurrent requests may share one engine batch, which can move an fp32 GEMM result by an ulp.
        torch.testing.assert_close(got.aux_hidden_states, want.aux_hidden_states)
        torch.testing.assert_close(got.logits, want.logits)
        assert torch.equal(got.input_ids, want.input_ids)


def test_a_full_queue_answers_429_and_the_client_comes_back_after_retry_after(
    spawn_server, tiny_llama_dir, llama_runner
):
    busy = spawn_server(tiny_llama_dir, "--max-queue", "1")
    # Occupy the engine with a long batch first, so the 6 concurrent requests below find it busy: one may
    # wait in the queue, the others must get 429 and come back after Retry-After.
    occupied: list[httpx.Response] = []
    occupier = threading.Thread(target=lambda: occupied.append(occupy_engine(busy.url)))
    tokens_before = batch_tokens_sum(busy.url)
    occupier.start()

    def long_batch_started() -> bool:
        if batch_tokens_sum(busy.url) != tokens_before:
            return True
        assert occupier.is_alive(), "the long batch never reached the engine"
        return False

    eventually(long_batch_started, "the long batch to reach the engine", timeout=120, interval=0.02)
    seeds = list(range(30, 38))
    with TargetClient(busy.url, **FAST_RETRIES) as client:
        delivered = list(client.prefetch((token_batch(seed, pad_last=3) for seed in seeds), depth=6))
        assert client.stats["status_429"] >= 1
    occupier.join()
    assert [r.status_code for r in occupied] == [200]
    for got, seed in zip(delivered, seeds, strict=True):
        want = reference(llama_runner, seed)
        torch.testing.assert_close(got.logits, want.logits)
        torch.testing.assert_close(got.aux_hidden_states, want.aux_hidden_states)


def occupy_engine(url: str) -> httpx.Response:
    """One supervision request of 8 x 1024 tokens in the `logits` format: seconds of engine work on CPU."""
    ids = torch.randint(0, 256, (8, 1024), generator=torch.Generator().manual_seed(0))
    return httpx.post(
        url + "/v1/supervision", params={"format": "logits"}, content=encode({"input_ids": ids}), timeout=300
    )


def batch_tokens_sum(url: str) -> float:
    """Tokens of every engine batch started so far (the worker records a batch as it starts it)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return next(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "eagle3_batch_tokens_sum"
    )


def test_a_restarted_endpoint_is_waited_for_and_a_changed_target_refused(
    spawn_server, tiny_llama_dir, llama_runner
):
    """Nothing listens, then the server loads (503), then serves. Restarted with other aux layers, the
    target's fingerprint changes: a strict client refuses it; a tolerant one adopts it (and drops caches)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    strict = TargetClient(url, give_up_after_s=180, **FAST_RETRIES)
    tolerant = TargetClient(url, allow_fingerprint_change=True, **FAST_RETRIES)
    fetcher, outcome = batch_in_thread(strict, token_batch(4, pad_last=3))

    def first_attempt_refused() -> bool:  # nothing listens yet: the first attempt must fail
        if strict.stats["connection_errors"]:
            return True
        assert fetcher.is_alive(), outcome
        return False

    eventually(first_attempt_refused, "a refused connection", timeout=60, interval=0.05)
    first = spawn_server(tiny_llama_dir, port=port, wait_ready=False)
    fetcher.join(timeout=180)
    [got] = outcome
    assert isinstance(got, Eagle3TargetBatch), got
    assert_identical(got, reference(llama_runner, seed=4))
    assert strict.stats["status_503"] >= 1, (strict.stats, first.log()[-2000:])

    input_ids = token_batch(5, pad_last=3)[0]
    tolerant.supervise(input_ids)
    assert tolerant.info().aux_layer_ids == [1, 3, 4]
    started_with = strict.fingerprint
    first.stop()
    spawn_server(tiny_llama_dir, "--aux-layer-ids", "0", "2", "5", port=port)
    with pytest.raises(FingerprintChanged) as changed:
        strict.supervise(input_ids)
    assert changed.value.expected == started_with != changed.value.got
    raw = tolerant.supervise(input_ids)
    assert raw["aux_hidden_states"].shape == (2, 16, 3 * 64)
    assert tolerant.fingerprint == changed.value.got
    assert tolerant.info().aux_layer_ids == [0, 2, 5]  # cached info was dropped with the old target
    strict.close()
    tolerant.close()


def test_bearer_token_is_sent(llama_server):
    """The data routes need the token; /v1/info (the model's identity) answers without it."""
    with TargetClient(llama_server.url) as anonymous, pytest.raises(RequestRejected) as rejected:
        assert anonymous.info().num_hidden_layers == 8
        anonymous.weight("lm_head")
    assert rejected.value.status_code == 401
    with TargetClient(llama_server.url, token=AUTH_TOKEN) as client:
        assert client.weight("lm_head").shape[0] == client.info().vocab_size


def test_client_by_resource_name_follows_endpoint_changes(
    cluster, namespace, objects, llama_server, llama_runner
):
    """The operator moved the target: the published endpoint died and a new one appeared in status."""
    dead = f"http://127.0.0.1:{free_port()}"
    published = target_status(1, "True", "Serving")
    published["model"] = published["model"] | {"fingerprint": llama_server_fingerprint(llama_server)}
    create_target(objects, namespace, "moving")
    write_status(objects, namespace, "moving", published | {"endpoints": [endpoint(dead)]})
    client = TargetClient(
        "moving",
        namespace=namespace,
        wait=30,
        kubeconfig=str(cluster.kubeconfig),
        token=AUTH_TOKEN,
        **FAST_RETRIES,
    )
    assert client.pool.urls == (dead,)
    write_status(objects, namespace, "moving", published | {"endpoints": [endpoint(llama_server.url)]})
    with client:
        assert_identical(client.batch(*token_batch(6, pad_last=3)), reference(llama_runner, seed=6))
    assert client.pool.urls == (llama_server.url,)
    assert client.stats["refreshes"] >= 1


def test_a_client_by_name_waits_its_own_wait_for_a_target_that_idled(
    cluster, namespace, objects, llama_server, llama_runner
):
    """A run paused past the idle window: its target went to zero. The client wakes it and waits for it as
    long as its `wait` says, far longer than its `give_up_after_s` of failing endpoints."""
    published = target_status(1, "True", "Serving")
    published["model"] = published["model"] | {"fingerprint": llama_server_fingerprint(llama_server)}
    gone = published | {"endpoints": [endpoint(f"http://127.0.0.1:{free_port()}")]}
    create_target(objects, namespace, "napping")
    write_status(objects, namespace, "napping", gone)  # the pod the client knows is gone
    client = TargetClient(
        "napping",
        namespace=namespace,
        wait=120,
        give_up_after_s=1,
        kubeconfig=str(cluster.kubeconfig),
        token=AUTH_TOKEN,
        **FAST_RETRIES,
    )
    asleep = {"conditions": target_status(1, "False", "Idle")["conditions"], "endpoints": []}
    write_status(objects, namespace, "napping", gone | asleep | {"idle": {"since": "2026-01-01T00:00:00Z"}})
    trainer, results = batch_in_thread(client, token_batch(7, pad_last=3))
    eventually(
        lambda: wake_annotation(objects, namespace, "napping"), "the client to wake its target", timeout=30
    )
    time.sleep(2)  # scheduling and a model load: past the client's give_up_after_s
    serving = published | {"endpoints": [endpoint(llama_server.url)], "idle": None}
    write_status(objects, namespace, "napping", serving)
    trainer.join(timeout=60)
    client.close()
    [batch] = results
    assert isinstance(batch, Eagle3TargetBatch), batch
    assert_identical(batch, reference(llama_runner, seed=7))


def endpoint(url: str) -> dict:
    return {"pod": "target-0", "address": url, "ready": True, "node": "gpu-0"}


def llama_server_fingerprint(server) -> str:
    headers = {"Authorization": f"Bearer {AUTH_TOKEN}"}
    return httpx.get(server.url + "/v1/info", headers=headers, timeout=10).json()["fingerprint"]


class FaultyRelay:
    """An endpoint that relays to a real server but spoils its first answers: cut short, then corrupted."""

    def __init__(self, upstream: str, faults: list[str]) -> None:
        self.upstream = upstream
        self.faults = list(faults)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"] if k.lower() in (b"authorization",)}
        async with httpx.AsyncClient() as http:
            answer = await http.request(
                scope["method"],
                self.upstream + scope["path"],
                params=scope["query_string"].decode(),
                content=body,
                headers=headers,
            )
        content = answer.content
        fault = self.faults.pop(0) if self.faults and scope["path"] == "/v1/supervision" else None
        await send(
            {
                "type": "http.response.start",
                "status": answer.status_code,
                "headers": [(b"content-length", str(len(content)).encode())],
            }
        )
        if fault == "cut":  # half the body, then the connection ends (uvicorn closes it)
            await send({"type": "http.response.body", "body": content[: len(content) // 2]})
            return
        if fault == "corrupt":  # the right length, but the header no longer parses
            content = b"\xff" * 16 + content[16:]
        await send({"type": "http.response.body", "body": content})


@pytest.mark.parametrize("fault", ["cut", "corrupt"])
def test_a_cut_or_corrupt_answer_is_retried_never_returned(llama_server, llama_runner, fault):
    input_ids, attention_mask, _ = token_batch(4)
    final, aux = llama_runner.forward_hidden(input_ids, attention_mask)
    with (
        serve_in_thread(FaultyRelay(llama_server.url, [fault])) as relay,
        TargetClient(relay, token=AUTH_TOKEN, **FAST_RETRIES) as client,
    ):
        got = client.supervise(input_ids, attention_mask, format="hidden")
    assert torch.equal(got["final_hidden"], final) and torch.equal(got["aux_hidden_states"], aux)
    counted = "connection_errors" if fault == "cut" else "corrupt_responses"
    assert client.stats[counted] == 1 and client.stats["requests"] == 2


def test_a_cut_answer_fails_over_to_the_other_endpoint(llama_server, llama_runner):
    input_ids, attention_mask, _ = token_batch(5)
    final, _ = llama_runner.forward_hidden(input_ids, attention_mask)
    with (
        serve_in_thread(FaultyRelay(llama_server.url, ["cut"] * 100)) as relay,
        TargetClient([relay, llama_server.url], token=AUTH_TOKEN, **FAST_RETRIES) as client,
    ):
        for _ in range(3):
            assert torch.equal(client.supervise(input_ids, attention_mask)["final_hidden"], final)
    assert client.stats["connection_errors"] >= 1


def batch_in_thread(
    client: TargetClient, tensors: TokenBatch
) -> tuple[threading.Thread, list[Eagle3TargetBatch | BaseException]]:
    """`client.batch(*tensors)` on a started thread; its batch, or what it raised, lands in the list."""
    outcome: list[Eagle3TargetBatch | BaseException] = []

    def fetch() -> None:
        try:
            outcome.append(client.batch(*tensors))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=fetch)
    thread.start()
    return thread, outcome
