"""The server state's engine call: which engine failures are the client's, a full queue as 429, and the job
of a client that left while it waited dropped before the engine runs it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from eagle3_target.runners import InvalidInput
from eagle3_target.server.app import create_app
from eagle3_target.server.batching import EngineJob
from eagle3_target.server.errors import http_status
from eagle3_target.server.refusals import Busy, Invalid
from eagle3_target.server.settings import ServerSettings
from eagle3_target.server.state import ServerState
from eagle3_target.wire import tensors as tensor_wire

from support.cluster.waiting import eventually
from support.engine_jobs import Blocker
from support.server_process import connect, serve_in_thread
from support.supervision import metric_samples


async def staying() -> None:
    """A client that stays until it is answered."""
    await asyncio.Event().wait()


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
        with pytest.raises(Invalid, match="row has 9 tokens"):
            asyncio.run(state.run_on_engine(raising(InvalidInput("a row has 9 tokens")), staying))
        with pytest.raises(ValueError, match="shape mismatch"):
            asyncio.run(state.run_on_engine(raising(ValueError("internal shape mismatch")), staying))
    finally:
        state.worker.stop()


def test_a_full_queue_is_429_with_retry_after():
    state = ServerState(ServerSettings(model="unused", max_queue=1))
    inputs = {"input_ids": torch.zeros(1, 2, dtype=torch.int64)}
    state.worker.submit(EngineJob(batch_key="k", inputs=inputs, compute=dict))  # the worker is not running
    with pytest.raises(Busy, match="1 requests waiting") as excinfo:
        job = EngineJob(batch_key="k", inputs=inputs, compute=dict)
        asyncio.run(state.run_on_engine(job, staying))
    assert (http_status(excinfo.value), excinfo.value.retry_after_s) == (429, 1)


@pytest.fixture(scope="module")
def in_process(server_model_dir: Path) -> Iterator[tuple[str, ServerState]]:
    """The app on a real socket in this process, so a test can hold its engine thread."""
    app = create_app(
        ServerSettings(model=str(server_model_dir), engine="hf", dtype="float32", max_model_len=256)
    )
    with serve_in_thread(app) as url:
        eventually(lambda: httpx.get(url + "/readyz").status_code == 200, "the model to load")
        yield url, app.state.server


def test_the_queued_job_of_a_client_that_left_is_never_computed(in_process):
    url, state = in_process
    samples = metric_samples(url)
    batches = samples[("eagle3_batch_tokens_count", ())]
    closed = ("eagle3_requests_total", (("code", "499"), ("route", "/v1/supervision")))
    body = tensor_wire.encode({"input_ids": torch.arange(8).reshape(1, 8)})
    blocker = Blocker()
    state.worker.submit(blocker.job)
    try:
        assert blocker.running.wait(timeout=30)
        with connect(url) as sock:
            sock.sendall(
                f"POST /v1/supervision HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            eventually(lambda: metric_samples(url)[("eagle3_queue_depth", ())] == 1, "the request to queue")
        # The client is gone: its job leaves the queue while the engine is still busy.
        eventually(lambda: metric_samples(url)[("eagle3_queue_depth", ())] == 0, "the job to leave the queue")
        eventually(lambda: metric_samples(url).get(closed, 0) == samples.get(closed, 0) + 1, "a 499")
    finally:
        blocker.release.set()
    eventually(lambda: metric_samples(url)[("eagle3_batch_tokens_count", ())] == batches + 1, "the blocker")
    assert httpx.post(url + "/v1/supervision", content=body).status_code == 200  # and the server serves on
    assert metric_samples(url)[("eagle3_batch_tokens_count", ())] == batches + 2
