"""Real target servers (subprocesses on loopback) and the in-process HF reference for the client tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from eagle3_target.runners.hf import HFRunner

from support.server_process import AUTH_TOKEN, ServerProcess, start_on_port, start_server

HF_ARGS = ["--engine", "hf", "--dtype", "float32"]


@pytest.fixture(scope="session")
def llama_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for the whole session, bearer-token protected: clients must send `AUTH_TOKEN`."""
    logs = tmp_path_factory.mktemp("server-logs")
    token_file = logs / "token"
    token_file.write_text(AUTH_TOKEN + "\n")
    args = ["--model", str(tiny_llama_dir), *HF_ARGS, "--auth-token-file", str(token_file)]
    server = start_server(logs, args)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def llama_runner(tiny_llama_dir: Path) -> HFRunner:
    """The in-process reference the client must match (same default aux layers as the server)."""
    return HFRunner.from_pretrained(tiny_llama_dir, dtype="float32", device="cpu")


@pytest.fixture
def spawn_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Start servers (optionally on a given port, without waiting for Ready); all are stopped afterwards."""
    started: list[ServerProcess] = []

    def spawn(model: Path, *extra: str, port: int | None = None, wait_ready: bool = True) -> ServerProcess:
        if port is None:
            server = start_server(tmp_path, ["--model", str(model), *HF_ARGS, *extra], wait_ready=wait_ready)
        else:
            server = start_on_port(tmp_path, port, ["--model", str(model), *HF_ARGS, *extra])
            if wait_ready:
                server.wait_until("/readyz", 200)
        started.append(server)
        return server

    yield spawn
    for server in started:
        if server.process.poll() is None:
            server.stop()
