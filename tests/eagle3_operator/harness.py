"""Running the operator and target servers for tests and benchmarks: the operator as a real subprocess
against a cluster, and one real target-server app answering at any number of pod IP:port sockets.

Target servers: the target server's own `create_app` (tiny HF model, loaded once) behind one uvicorn server
per socket; a socket per pod IP:port is exactly what a server process inside that pod would bind.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import kubernetes
import uvicorn

from tests.cluster.processes import kill_when_parent_dies, terminate
from tests.cluster.waiting import LOOPBACK, eventually, free_port

# The operator tests wait longer by default: a reconcile may sit out a retry backoff first.
wait_for = functools.partial(eventually, timeout=90.0, interval=0.3)


class OperatorProcess:
    """`eagle3-operator` as a subprocess: startable, killable (SIGKILL) and restartable, with its metrics.
    The kernel kills it if the test process dies without stopping it."""

    def __init__(
        self, kubeconfig: Path, log_dir: Path, namespaces: Sequence[str], reprobe_seconds: float = 1.0
    ) -> None:
        self.kubeconfig = kubeconfig
        self.log_dir = log_dir
        self.namespaces = list(namespaces)
        self.reprobe_seconds = reprobe_seconds
        self.process: subprocess.Popen[bytes] | None = None
        self.metrics_port = 0
        self.liveness_port = 0
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"operator-{self.starts}.log"

    def start(self) -> None:
        self.starts += 1
        self.metrics_port, self.liveness_port = free_port(), free_port()
        exe = shutil.which("eagle3-operator", path=str(Path(sys.executable).parent))
        argv = [exe] if exe else [sys.executable, "-c", "from eagle3_operator.cli import main; main()"]
        argv += [
            *(f"--namespace={namespace}" for namespace in self.namespaces),
            f"--liveness=http://{LOOPBACK}:{self.liveness_port}/healthz",
            f"--metrics-port={self.metrics_port}",
            f"--metrics-address={LOOPBACK}",
            f"--reprobe-seconds={self.reprobe_seconds}",
            "--api-timeout-seconds=10",
        ]
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "NO_PROXY": "*"}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=kill_when_parent_dies
            )
        wait_for(self._alive, "the operator's liveness endpoint", timeout=60)

    def _alive(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            raise AssertionError(f"operator exited:\n{self.log()[-4000:]}")
        try:
            return httpx.get(f"http://{LOOPBACK}:{self.liveness_port}/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def kill(self) -> None:
        """SIGKILL: no cleanup at all, as when a node dies under the operator."""
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None:
            terminate(self.process)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def peak_rss_bytes(self) -> int:
        """The process's peak resident memory so far (VmHWM)."""
        assert self.process is not None
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE).group(1)) * 1024

    def metric_total(self, name: str) -> float:
        """The sum of a metric's samples over all label values."""
        text = httpx.get(f"http://{LOOPBACK}:{self.metrics_port}/metrics", timeout=5).text
        return sum(
            float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
        )

    def metric(self, name: str, **labels: str) -> float:
        """One sample from the operator's /metrics (0 when absent)."""
        text = httpx.get(f"http://{LOOPBACK}:{self.metrics_port}/metrics", timeout=5).text
        wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
        pattern = re.escape(name) + (r"\{" + re.escape(wanted) + r"\}" if labels else "") + r" (\S+)"
        match = re.search(rf"^{pattern}$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0


class ServerFarm:
    """One real target-server app (model loaded once) listening on any number of IP:port sockets."""

    def __init__(self, model_dir: Path, auth_token_file: Path | None = None) -> None:
        from eagle3_target.server.app import create_app
        from eagle3_target.server.settings import ServerSettings

        settings = ServerSettings(
            model=str(model_dir),
            engine="hf",
            dtype="float32",
            model_name="tiny-llama",
            auth_token_file=auth_token_file,
        )
        self.app = create_app(settings)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="server-farm", daemon=True)
        self._thread.start()
        self._servers: dict[tuple[str, int], tuple[uvicorn.Server, Any]] = {}
        self.primary = (LOOPBACK, free_port())
        self._serve(*self.primary, lifespan="on")  # loads the model; the other sockets share it
        url = f"http://{LOOPBACK}:{self.primary[1]}/readyz"
        wait_for(lambda: _status(url) == 200, "the target server to load its model", timeout=180)

    def _serve(self, host: str, port: int, lifespan: str) -> None:
        config = uvicorn.Config(self.app, host=host, port=port, lifespan=lifespan, log_level="warning")
        server = uvicorn.Server(config)
        future = asyncio.run_coroutine_threadsafe(server.serve(), self._loop)
        self._servers[host, port] = (server, future)

        def started() -> bool:
            if future.done():
                raise AssertionError(f"server on {host}:{port} stopped: {future.exception()!r}")
            return server.started

        wait_for(started, f"a server socket on {host}:{port}", timeout=30, interval=0.05)

    def bind(self, host: str, port: int) -> str:
        """Answer at host:port (a pod's IP and spec.port); returns the base URL."""
        if (host, port) not in self._servers:
            self._serve(host, port, lifespan="off")
        return f"http://{host}:{port}"

    def unbind(self, host: str, port: int) -> None:
        entry = self._servers.pop((host, port), None)
        if entry is not None:
            entry[0].should_exit = True
            entry[1].result(timeout=30)

    def close(self) -> None:
        for address in [a for a in self._servers if a != self.primary]:
            self.unbind(*address)
        self.unbind(*self.primary)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


class PodServing:
    """Keeps a real server answering at IP:port of every running pod in a namespace (as the pod's own
    server process would), for the ports it has been told to serve."""

    def __init__(self, core: kubernetes.client.CoreV1Api, namespace: str, farm: ServerFarm) -> None:
        self.core = core
        self.namespace = namespace
        self.farm = farm
        self.ports: set[int] = set()
        self.bound: set[tuple[str, int]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pod-serving", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            pods = self.core.list_namespaced_pod(self.namespace).items
            for pod in pods:
                for port in list(self.ports):
                    address = (pod.status.pod_ip, port)
                    if pod.status.pod_ip and address not in self.bound:
                        self.farm.bind(*address)
                        self.bound.add(address)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for address in self.bound:
            self.farm.unbind(*address)


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.TransportError:
        return None
