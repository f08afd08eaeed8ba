"""The server's pure parts without a process: auth check, settings parsing, fingerprint, vocab bindings,
and the engine worker's queue and coalescing."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch
from eagle3_target.protocol import read_token_file
from eagle3_target.runners import InvalidInput
from eagle3_target.server.auth import bearer_matches
from eagle3_target.server.batching import EngineJob, EngineWorker, QueueFull, run_coalesced
from eagle3_target.server.errors import TooManyRequests, Unprocessable
from eagle3_target.server.fingerprint import model_fingerprint, sample_offsets, weight_file_digest
from eagle3_target.server.metrics import ServerMetrics
from eagle3_target.server.request_tracking import pick_request_id
from eagle3_target.server.settings import ServerSettings, parse_engine_arg
from eagle3_target.server.state import ServerState
from eagle3_target.server.vocab_store import LruDict, NemoMappingBindings, UnboundConnection


def test_bearer_matches():
    assert bearer_matches("Bearer tok", "tok")
    assert bearer_matches("bearer tok", "tok")
    assert not bearer_matches(None, "tok")
    assert not bearer_matches("Bearer tok2", "tok")
    assert not bearer_matches("Basic tok", "tok")
    assert not bearer_matches("tok", "tok")


def test_token_file_is_stripped_and_must_not_be_empty(tmp_path: Path):
    (tmp_path / "t").write_text("  abc\n")
    assert read_token_file(tmp_path / "t") == "abc"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_token_file(tmp_path / "empty")


@pytest.mark.parametrize(
    ("item", "parsed"),
    [
        ("gpu_memory_utilization=0.85", ("gpu_memory_utilization", 0.85)),
        ("enforce-eager=true", ("enforce_eager", True)),
        ("max_num_seqs=8", ("max_num_seqs", 8)),
        ("kv_cache_dtype=fp8", ("kv_cache_dtype", "fp8")),
        ("cudagraph_capture_sizes=[1,2,4]", ("cudagraph_capture_sizes", [1, 2, 4])),
        ("x=a=b", ("x", "a=b")),
        ("enable_prefix_caching=False", ("enable_prefix_caching", False)),
    ],
)
def test_parse_engine_arg(item, parsed):
    assert parse_engine_arg(item) == parsed


@pytest.mark.parametrize("item", ["novalue", "=3", ""])
def test_parse_engine_arg_rejects(item):
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_engine_arg(item)


def test_settings_validate():
    with pytest.raises(ValueError, match="engine"):
        ServerSettings(model="m", engine="tgi")
    with pytest.raises(ValueError, match="max_queue"):
        ServerSettings(model="m", max_queue=0)
    with pytest.raises(ValueError, match="3 aux"):
        ServerSettings(model="m", aux_layer_ids=(1, 2))
    assert ServerSettings(model="m", max_batch_tokens=10).token_body_limit > 10 * 24


def test_request_ids():
    assert pick_request_id("abc-123") == "abc-123"
    fresh = pick_request_id("spaces are not ok")
    assert fresh != "spaces are not ok" and len(fresh) == 32
    assert pick_request_id(None) != pick_request_id(None)


def test_sample_offsets_cover_the_file():
    assert sample_offsets(100) == [0]
    offsets = sample_offsets(1_000_000)
    assert offsets[0] == 0 and offsets[-1] == 1_000_000 - 4096 and len(offsets) == 4


def test_fingerprint_is_stable_and_sensitive(tiny_llama_dir: Path, tmp_path: Path):
    def fingerprint(path: Path, **overrides) -> str:
        args = {
            "model_name": "m",
            "revision": "r",
            "dtype": "float32",
            "engine": "hf",
            "aux_layer_ids": [1, 3, 4],
        }
        return model_fingerprint(str(path), **(args | overrides))

    base = fingerprint(tiny_llama_dir)
    assert base.startswith("sha256:") and base == fingerprint(tiny_llama_dir)
    for change in (
        {"revision": "r2"},
        {"dtype": "bfloat16"},
        {"engine": "vllm"},
        {"aux_layer_ids": [1, 3, 5]},
    ):
        assert fingerprint(tiny_llama_dir, **change) != base
    # The same weights elsewhere are the same model.
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in tiny_llama_dir.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert fingerprint(copy) == base
    # A changed byte inside a sampled region (the file's start: the safetensors header) changes it.
    shard = sorted(copy.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    before = weight_file_digest(shard)
    data[-1] ^= 0xFF  # the last sample always ends at the file's end
    shard.write_bytes(bytes(data))
    assert weight_file_digest(shard) != before
    assert fingerprint(copy) != base


def test_lru_dict_forgets_least_recently_used():
    lru: LruDict[int] = LruDict(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # a is now the most recent
    lru.put("c", 3)
    assert lru.get("b") is None and lru.get("a") == 1 and lru.get("c") == 3
    assert len(lru) == 2


def test_nemo_bindings_by_connection_then_host():
    bindings = NemoMappingBindings()
    with pytest.raises(UnboundConnection, match="set_vocab_mapping"):
        bindings.resolve("10.0.0.1", 5000)
    bindings.bind("10.0.0.1", 5000, "map-a")
    assert bindings.resolve("10.0.0.1", 5000) == "map-a"
    # A reconnect from the same host that only ever set one mapping keeps using it.
    assert bindings.resolve("10.0.0.1", 6000) == "map-a"
    bindings.bind("10.0.0.1", 5001, "map-b")
    assert bindings.resolve("10.0.0.1", 5000) == "map-a"
    assert bindings.resolve("10.0.0.1", 5001) == "map-b"
    with pytest.raises(UnboundConnection, match="2 different vocab mappings"):
        bindings.resolve("10.0.0.1", 6000)
    with pytest.raises(UnboundConnection):
        bindings.resolve("10.0.0.2", 5000)


def double(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"doubled": inputs["input_ids"] * 2, "row_sum": inputs["input_ids"].sum(dim=1)}


def job(rows: int, seq: int, start: int, key: object = "k") -> EngineJob:
    ids = torch.arange(start, start + rows * seq).reshape(rows, seq)
    return EngineJob(batch_key=key, inputs={"input_ids": ids}, compute=double)


def test_run_coalesced_splits_rows_back():
    jobs = [job(1, 3, 0), job(2, 3, 100), job(3, 3, 1000)]
    results = run_coalesced(jobs)
    for j, result in zip(jobs, results, strict=True):
        assert torch.equal(result["doubled"], j.inputs["input_ids"] * 2)
        assert torch.equal(result["row_sum"], j.inputs["input_ids"].sum(dim=1))


def test_worker_coalesces_compatible_jobs_and_bounds_the_queue():
    metrics = ServerMetrics()
    worker = EngineWorker(max_queue=3, max_batch_tokens=12, metrics=metrics)
    running, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def blocking(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        running.set()
        release.wait(timeout=30)
        return double(inputs)

    def counting(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        calls.append(int(inputs["input_ids"].shape[0]))
        return double(inputs)

    worker.start()
    try:
        blocker = EngineJob(
            batch_key="block", inputs={"input_ids": torch.zeros(1, 1, dtype=torch.int64)}, compute=blocking
        )
        first = worker.submit(blocker)
        assert running.wait(timeout=30)
        queued = [job(1, 4, 0), job(2, 4, 100), job(1, 4, 200)]
        for j in queued:
            j.compute = counting
        futures = [worker.submit(j) for j in queued]
        assert metrics.registry.get_sample_value("eagle3_queue_depth") == 3
        with pytest.raises(QueueFull, match="3 requests waiting"):
            worker.submit(job(1, 4, 300))
        release.set()
        assert torch.equal(first.result(timeout=30)["doubled"], torch.zeros(1, 1, dtype=torch.int64))
        for j, future in zip(queued, futures, strict=True):
            assert torch.equal(future.result(timeout=30)["doubled"], j.inputs["input_ids"] * 2)
        # 12 tokens fit: the first two (4 + 8) share one call, the third runs alone.
        assert calls == [3, 1]
    finally:
        release.set()
        worker.stop()


def test_worker_keeps_keys_and_lengths_apart_and_survives_errors():
    worker = EngineWorker(max_queue=8, max_batch_tokens=1000, metrics=ServerMetrics())

    def failing(_inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise RuntimeError("engine exploded")

    worker.start()
    try:
        bad = EngineJob(
            batch_key="bad", inputs={"input_ids": torch.zeros(1, 2, dtype=torch.int64)}, compute=failing
        )
        futures = [
            worker.submit(bad),
            worker.submit(job(1, 2, 0, key="a")),
            worker.submit(job(1, 3, 10, key="a")),
        ]
        with pytest.raises(RuntimeError, match="exploded"):
            futures[0].result(timeout=30)
        assert futures[1].result(timeout=30)["doubled"].shape == (1, 2)
        assert futures[2].result(timeout=30)["doubled"].shape == (1, 3)
    finally:
        worker.stop()


def test_a_failing_request_does_not_fail_the_requests_it_shares_a_batch_with():
    metrics = ServerMetrics()
    worker = EngineWorker(max_queue=8, max_batch_tokens=1000, metrics=metrics)
    running, release = threading.Event(), threading.Event()
    rows_per_call: list[int] = []

    def blocking(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        running.set()
        release.wait(timeout=30)
        return double(inputs)

    def refuses_negative_ids(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rows_per_call.append(int(inputs["input_ids"].shape[0]))
        if bool((inputs["input_ids"] < 0).any()):
            raise ValueError("negative token id")
        return double(inputs)

    worker.start()
    try:
        worker.submit(
            EngineJob(
                batch_key="b", inputs={"input_ids": torch.zeros(1, 1, dtype=torch.int64)}, compute=blocking
            )
        )
        assert running.wait(timeout=30)
        good = [job(1, 3, 0), job(1, 3, 10)]
        poison = EngineJob(
            batch_key="k", inputs={"input_ids": -torch.ones(1, 3, dtype=torch.int64)}, compute=double
        )
        for j in (*good, poison):
            j.compute = refuses_negative_ids
        futures = [worker.submit(good[0]), worker.submit(poison), worker.submit(good[1])]
        release.set()
        with pytest.raises(ValueError, match="negative"):
            futures[1].result(timeout=30)
        for j, future in zip(good, (futures[0], futures[2]), strict=True):
            assert torch.equal(future.result(timeout=30)["doubled"], j.inputs["input_ids"] * 2)
        # The three really shared one engine call (one 9-token batch after the 1-token blocker), and
        # only its failure sent them back one at a time.
        assert rows_per_call == [3, 1, 1, 1]
        assert metrics.registry.get_sample_value("eagle3_batch_tokens_count") == 2
        assert metrics.registry.get_sample_value("eagle3_batch_tokens_sum") == 1 + 9
    finally:
        release.set()
        worker.stop()


def test_only_invalid_input_from_the_engine_is_a_client_error():
    """A runner's InvalidInput becomes 422; any other ValueError is a server bug and stays one (500)."""
    state = ServerState(ServerSettings(model="unused"))

    def raising(error: Exception) -> EngineJob:
        def compute(_inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            raise error

        return EngineJob(
            batch_key="k", inputs={"input_ids": torch.zeros(1, 2, dtype=torch.int64)}, compute=compute
        )

    state.worker.start()
    try:
        with pytest.raises(Unprocessable, match="row has 9 tokens"):
            asyncio.run(state.run_on_engine(raising(InvalidInput("a row has 9 tokens"))))
        with pytest.raises(ValueError, match="shape mismatch"):
            asyncio.run(state.run_on_engine(raising(ValueError("internal shape mismatch"))))
    finally:
        state.worker.stop()


def test_a_full_queue_is_429_with_retry_after():
    state = ServerState(ServerSettings(model="unused", max_queue=1))
    inputs = {"input_ids": torch.zeros(1, 2, dtype=torch.int64)}
    state.worker.submit(EngineJob(batch_key="k", inputs=inputs, compute=dict))  # the worker is not running
    with pytest.raises(TooManyRequests, match="1 requests waiting") as excinfo:
        asyncio.run(state.run_on_engine(EngineJob(batch_key="k", inputs=inputs, compute=dict)))
    assert (excinfo.value.status, excinfo.value.headers) == (429, {"Retry-After": "1"})
