"""The server state's engine call: which engine failures are the client's, and a full queue as 429."""

from __future__ import annotations

import asyncio

import pytest
import torch
from eagle3_target.runners import InvalidInput
from eagle3_target.server.batching import EngineJob
from eagle3_target.server.errors import TooManyRequests, Unprocessable
from eagle3_target.server.settings import ServerSettings
from eagle3_target.server.state import ServerState


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
