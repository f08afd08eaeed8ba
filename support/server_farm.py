"""One real target-server app answering at any number of pod IP:port sockets, for the operator tests and
the scale benchmark: the target server's own `create_app` (tiny HF model, loaded once) behind one uvicorn
server per socket; a socket per pod IP:port is exactly what a server process inside that pod would bind."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any, Literal

import httpx
import kubernetes
import uvicorn

from support.cluster.waiting import LOOPBACK, eventually, free_port
from support.server_process import status_code


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
        eventually(lambda: status_code(url) == 200, "the target server to load its model", timeout=180)

    def _serve(self, host: str, port: int, lifespan: Literal["on", "off"]) -> None:
        config = uvicorn.Config(self.app, host=host, port=port, lifespan=lifespan, log_level="warning")
        server = uvicorn.Server(config)
        future = asyncio.run_coroutine_threadsafe(server.serve(), self._loop)
        self._servers[host, port] = (server, future)

        def started() -> bool:
            if future.done():
                raise AssertionError(f"server on {host}:{port} stopped: {future.exception()!r}")
            return server.started

        eventually(started, f"a server socket on {host}:{port}", timeout=30, interval=0.05)

    def bind(self, host: str, port: int) -> str:
        """Answer at host:port (a pod's IP and spec.port); returns the base URL."""
        if (host, port) not in self._servers:
            self._serve(host, port, lifespan="off")
        return f"http://{host}:{port}"

    def info(self) -> dict[str, Any]:
        """The server's /v1/info, read at the primary socket (what probes and clients compare with)."""
        response = httpx.get(f"http://{self.primary[0]}:{self.primary[1]}/v1/info", timeout=5)
        return dict(response.json())

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
                ip = pod.status.pod_ip if pod.status else None
                if not ip:
                    continue
                for port in list(self.ports):
                    address = (ip, port)
                    if address not in self.bound:
                        self.farm.bind(*address)
                        self.bound.add(address)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for address in self.bound:
            self.farm.unbind(*address)

    def __enter__(self) -> PodServing:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
