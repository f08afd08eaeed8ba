"""Runs ``eagle3-target serve`` as a real subprocess on a loopback port (or an app in a thread), for the
server, client and trainer tests and the benchmarks, and the settings the tests' shared servers run with."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import uvicorn
from uvicorn._types import ASGIApplication

from support.cluster.processes import terminate
from support.cluster.waiting import LOOPBACK, eventually, free_port

# The bearer token of every test server that wants one (spec.auth, --auth-token-file).
AUTH_TOKEN = "s3cret-token"
# The limits the server tests' shared server runs with; tests probe just past them.
MAX_BATCH_TOKENS = 2048
MAX_MODEL_LEN = 256


def status_code(url: str, headers: dict[str, str] | None = None, timeout: float = 5) -> int | None:
    """The status a GET of `url` answers with, or None while nothing answers there (in time)."""
    try:
        return httpx.get(url, headers=headers, timeout=timeout).status_code
    except httpx.TransportError:
        return None


def connect(url: str, timeout: float | None = 30) -> socket.socket:
    """A raw connection to the server at `url`, for what an HTTP client library would not send or read."""
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=timeout)


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
        """Poll `path` until it answers `status`; fails at once, with the log, if the server exits."""

        def answered() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            return status_code(self.url + path, headers) == status

        try:
            eventually(answered, f"{path} to answer {status}", timeout=timeout)
        except TimeoutError as error:
            raise TimeoutError(f"{error}\n{self.log()[-4000:]}") from None

    def stop(self) -> None:
        terminate(self.process, grace_seconds=30)

    def memory_mib(self) -> dict[str, float]:
        """The server process's resident memory now (``VmRSS``) and at its peak so far (``VmHWM``), MiB."""
        lines = Path(f"/proc/{self.process.pid}/status").read_text().splitlines()
        fields = dict(line.split(":", 1) for line in lines if ":" in line)
        return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM")}


def launch(
    log_path: Path,
    port: int,
    args: list[str],
    env: dict[str, str] | None = None,
    gpus: bool = False,
    program: list[str] | None = None,
) -> ServerProcess:
    """Start a server on a loopback port, logging to `log_path`; returns as soon as the process runs. The
    tests run on CPU, so it sees no GPU unless `gpus` (a benchmark on a GPU machine). `program` replaces
    the `eagle3-target` command (a benchmark's wrapper that takes the same arguments)."""
    hide_gpus = {} if gpus else {"CUDA_VISIBLE_DEVICES": ""}
    full_env = {**os.environ, **hide_gpus, **(env or {})}
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [*(program or serve_command()), "serve", "--host", LOOPBACK, "--port", str(port), *args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=full_env,
        )
    return ServerProcess(f"http://{LOOPBACK}:{port}", process, log_path)


def start_on_port(log_dir: Path, port: int, args: list[str]) -> ServerProcess:
    """A server on a fixed port (to restart "the same" endpoint); returns as soon as the process runs."""
    return launch(log_dir / f"server-{port}-{len(list(log_dir.glob('*.log')))}.log", port, args)


def start_server(
    log_dir: Path,
    args: list[str],
    env: dict[str, str] | None = None,
    wait_ready: bool = True,
    gpus: bool = False,
    ready_timeout: float = 180.0,
) -> ServerProcess:
    """Start a server on a free loopback port; by default wait until /readyz says 200 (a real engine's
    start can take longer than the default `ready_timeout`)."""
    port = free_port()
    server = launch(log_dir / f"server-{port}.log", port, args, env, gpus)
    try:
        server.wait_until("/healthz", 200)
        if wait_ready:
            server.wait_until("/readyz", 200, timeout=ready_timeout)
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def serve_in_thread(app: ASGIApplication) -> Iterator[str]:
    """Run an ASGI app under a real uvicorn server on a loopback port in this process; yields its URL."""
    config = uvicorn.Config(app, host=LOOPBACK, port=free_port(), log_config=None, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    def started() -> bool:
        if not thread.is_alive():
            raise RuntimeError("in-process server did not start")
        return server.started

    eventually(started, "the in-process server to start", timeout=60, interval=0.05)
    try:
        yield f"http://{LOOPBACK}:{config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
