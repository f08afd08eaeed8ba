"""Probing target servers: answers are parsed strictly, failures are told apart (unreachable vs not ready).

A real HTTP server on loopback answers: the target server's own app, loaded with a tiny model.
"""

import asyncio
import shutil
from pathlib import Path

import httpx
from eagle3_operator.probe import Prober
from eagle3_target.hydrate import ProgressTracker, serve_progress
from eagle3_target.protocol import HydrationProgress
from eagle3_target.server.app import create_app
from eagle3_target.server.settings import ServerSettings

from tests.cluster.waiting import free_port
from tests.eagle3_operator.conftest import AUTH_TOKEN
from tests.eagle3_operator.harness import LOOPBACK, ServerFarm, wait_for
from tests.eagle3_target.server.server_process import serve_in_thread


def test_ready_server_reports_its_model(servers: ServerFarm):
    url = f"http://{servers.primary[0]}:{servers.primary[1]}"
    expected = httpx.get(f"{url}/v1/info").json()
    prober = Prober()
    result = asyncio.run(_probe(prober, {"pod-a": url}))["pod-a"]
    assert result.ready and result.reachable and result.error is None
    assert (result.info.fingerprint, result.info.num_hidden_layers) == (expected["fingerprint"], 8)
    assert result.info.name == "tiny-llama"


def test_nothing_listening_is_unreachable():
    result = asyncio.run(_probe(Prober(), {"pod-b": f"http://{LOOPBACK}:{free_port()}"}))["pod-b"]
    assert (result.ready, result.reachable) == (False, False)
    assert "ConnectError" in result.error


def test_wrong_server_is_reachable_but_not_ready(servers: ServerFarm):
    """Something answers, but not a target server: /v1/info is missing (the app has no such route here)."""
    url = f"http://{servers.primary[0]}:{servers.primary[1]}/not-a-target"
    result = asyncio.run(_probe(Prober(), {"pod-c": url}))["pod-c"]
    assert (result.ready, result.reachable) == (False, True)
    assert "/readyz answered 404" in result.error


def test_token_protected_server_needs_the_token(auth_servers: ServerFarm):
    url = f"http://{auth_servers.primary[0]}:{auth_servers.primary[1]}"
    without = asyncio.run(_probe(Prober(), {"p": url}))["p"]
    assert (without.ready, without.reachable, without.error) == (False, True, "/v1/info answered 401")
    wrong = asyncio.run(_probe(Prober(), {"p": url}, token="not-it"))["p"]
    assert wrong.error == "/v1/info answered 401"
    right = asyncio.run(_probe(Prober(), {"p": url}, token=AUTH_TOKEN))["p"]
    assert right.ready and right.info is not None


def test_a_loading_server_says_how_far_it_has_come(tiny_model_dir: Path, tmp_path: Path):
    """A model directory whose weights have not arrived yet: the server waits and its 503 says so."""
    shutil.copy(tiny_model_dir / "config.json", tmp_path)
    with serve_in_thread(create_app(ServerSettings(model=str(tmp_path), engine="hf"))) as url:

        def progress():
            result = asyncio.run(_probe(Prober(), {"p": url}))["p"]
            return result if result.progress and "waiting" in result.progress else None

        result = wait_for(progress, "the server's load progress", timeout=60)
    assert (result.ready, result.reachable) == (False, True)
    assert result.progress.startswith("waiting for weights: no weights yet (no model.safetensors")
    assert result.error == f"/readyz answered 503: {result.progress}"


async def _probe(prober: Prober, addresses: dict[str, str], token: str | None = None):
    try:
        return await prober.probe_many(addresses, token)
    finally:
        await prober.close()


def test_a_running_download_reports_its_progress_and_silence_is_not_an_error(tmp_path):
    """The hydrate command's own progress server, read the way the reconciler reads it."""
    tracker = ProgressTracker(tmp_path)
    tracker.plan([("model.safetensors", 2000), ("config.json", 5)])
    (tmp_path / "config.json").write_bytes(b"{}   ")
    server = serve_progress(tracker, port := free_port())

    async def read(url: str) -> HydrationProgress | None:
        prober = Prober()
        try:
            return await prober.hydration_progress(url)
        finally:
            await prober.close()

    try:
        progress = asyncio.run(read(f"http://{LOOPBACK}:{port}"))
    finally:
        server.shutdown()
    assert progress == HydrationProgress(files_done=1, files_total=2, bytes_done=5, bytes_total=2005)
    assert asyncio.run(read(f"http://{LOOPBACK}:{free_port()}")) is None
