"""Runs ``eagle3-target serve`` as a real subprocess on a loopback port, for the server and client tests
and the benchmarks."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from tests.cluster.processes import terminate
from tests.cluster.waiting import LOOPBACK, free_port


def serve_command() -> list[str]:
    exe = shutil.which("eagle3-target", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "eagle3_target.cli"]


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen
    log_path: Path
    metrics_url: str | None = None  # where --metrics-port serves /metrics, when it is set

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_until(self, path: str, status: int, timeout: float = 180.0, headers: dict | None = None) -> None:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                last = httpx.get(self.url + path, headers=headers, timeout=5).status_code
                if last == status:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{path} never answered {status} (last {last}):\n{self.log()[-4000:]}")

    def stop(self) -> None:
        terminate(self.process, grace_seconds=30)


def launch(
    log_path: Path, port: int, args: list[str], env: dict[str, str] | None = None, gpus: bool = False
) -> ServerProcess:
    """Start a server on a loopback port, logging to `log_path`; returns as soon as the process runs. The
    tests run on CPU, so it sees no GPU unless `gpus` (a benchmark on a GPU machine)."""
    hide_gpus = {} if gpus else {"CUDA_VISIBLE_DEVICES": ""}
    full_env = {**os.environ, **hide_gpus, **(env or {})}
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [*serve_command(), "serve", "--host", LOOPBACK, "--port", str(port), *args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=full_env,
        )
    return ServerProcess(f"http://{LOOPBACK}:{port}", process, log_path)


def start_server(
    log_dir: Path,
    args: list[str],
    env: dict[str, str] | None = None,
    wait_ready: bool = True,
    gpus: bool = False,
) -> ServerProcess:
    """Start a server on a free loopback port; by default wait until /readyz says 200."""
    port = free_port()
    server = launch(log_dir / f"server-{port}.log", port, args, env, gpus)
    try:
        server.wait_until("/healthz", 200)
        if wait_ready:
            server.wait_until("/readyz", 200)
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def serve_in_thread(app: object) -> Iterator[str]:
    """Run an ASGI app under a real uvicorn server on a loopback port in this process; yields its URL."""
    config = uvicorn.Config(app, host=LOOPBACK, port=free_port(), log_config=None, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("in-process server did not start")
        time.sleep(0.05)
    try:
        yield f"http://{LOOPBACK}:{config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
