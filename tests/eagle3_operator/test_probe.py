"""Probing target servers over real sockets: answers are parsed strictly, failures are told apart and never
raise, a hung server costs one timeout and blocks nobody else, and a serving endpoint flips to not ready
only after consecutive failures.

The servers are the target server's own app with a tiny model (ServerFarm) and raw asyncio sockets that
accept connections and never answer.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from eagle3_operator.probe import NOT_PROBED, Prober
from eagle3_operator.status.observation import ProbeResult
from eagle3_target.hydrate import ProgressTracker, serve_progress
from eagle3_target.protocol import HydrationProgress
from eagle3_target.server.app import create_app
from eagle3_target.server.settings import ServerSettings

from support.cluster.waiting import LOOPBACK, eventually, free_port
from support.server_farm import ServerFarm
from support.server_process import AUTH_TOKEN, serve_in_thread

FAST = httpx.Timeout(0.5, connect=0.5)


def url_of(farm: ServerFarm) -> str:
    return f"http://{farm.primary[0]}:{farm.primary[1]}"


async def check(url: str) -> ProbeResult:
    prober: Prober[str] = Prober(lambda key: None, interval=60, timeout=FAST)
    try:
        return await prober.check(url)
    finally:
        await prober.close()


@asynccontextmanager
async def hung_server() -> AsyncIterator[str]:
    """Accepts connections, reads, never answers: a server wedged in a long forward pass."""
    held: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.read(65536)

    server = await asyncio.start_server(accept, LOOPBACK, 0)
    try:
        yield f"http://{LOOPBACK}:{server.sockets[0].getsockname()[1]}"
    finally:
        for writer in held:
            writer.close()
        server.close()


def test_ready_server_reports_its_model(servers: ServerFarm):
    expected = httpx.get(f"{url_of(servers)}/v1/info").json()
    result = asyncio.run(check(url_of(servers)))
    assert result.ready and result.reachable and result.error is None
    assert (result.info.fingerprint, result.info.num_hidden_layers) == (expected["fingerprint"], 8)
    assert result.info.name == "tiny-llama"


def test_nothing_listening_is_unreachable():
    result = asyncio.run(check(f"http://{LOOPBACK}:{free_port()}"))
    assert (result.ready, result.reachable) == (False, False)
    assert "ConnectError" in result.error


def test_wrong_server_is_reachable_but_not_ready(servers: ServerFarm):
    """Something answers, but not a target server: /readyz is missing there."""
    result = asyncio.run(check(f"{url_of(servers)}/not-a-target"))
    assert (result.ready, result.reachable) == (False, True)
    assert "/readyz answered 404" in result.error


def test_token_protected_server_is_probed_without_any_token(auth_servers: ServerFarm):
    """/readyz and /v1/info answer without credentials, and the prober sends none; the data routes refuse."""
    result = asyncio.run(check(url_of(auth_servers)))
    assert result.ready and result.info is not None and result.info.name == "tiny-llama"
    refused = httpx.get(f"{url_of(auth_servers)}/v1/weights/lm_head")
    assert refused.status_code == 401
    allowed = httpx.get(
        f"{url_of(auth_servers)}/v1/weights/lm_head", headers={"Authorization": f"Bearer {AUTH_TOKEN}"}
    )
    assert allowed.status_code == 200


def test_a_loading_server_says_how_far_it_has_come(tiny_llama_dir: Path, tmp_path: Path):
    """A model directory whose weights have not arrived yet: the server waits and its 503 says so."""
    shutil.copy(tiny_llama_dir / "config.json", tmp_path)
    with serve_in_thread(create_app(ServerSettings(model=str(tmp_path), engine="hf"))) as url:

        def progress():
            result = asyncio.run(check(url))
            return result if result.progress and "waiting" in result.progress else None

        result = eventually(progress, "the server's load progress", timeout=60)
    assert (result.ready, result.reachable) == (False, True)
    assert result.progress.startswith("waiting for weights: no weights yet (no model.safetensors")
    assert result.error == f"/readyz answered 503: {result.progress}"


def test_a_running_download_reports_its_progress_and_silence_is_not_an_error(tmp_path):
    """The hydrate command's own progress server, read the way the reconciler reads it."""
    tracker = ProgressTracker(tmp_path)
    tracker.plan([("model.safetensors", 2000), ("config.json", 5)])
    (tmp_path / "config.json").write_bytes(b"{}   ")
    server = serve_progress(tracker, port := free_port())

    async def read(url: str) -> HydrationProgress | None:
        prober: Prober[str] = Prober(lambda key: None, interval=60)
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


def test_bad_addresses_are_reported_not_raised():
    """An unbracketed IPv6 address is an invalid URL to httpx (not an HTTPError); it must not escape."""
    for url in ("http://fd00::5:8000", "http://[fd00::5]:99999", "ftp://127.0.0.1:1"):
        result = asyncio.run(check(url))
        assert not result.ready and result.error, url


def test_hung_server_costs_one_timeout_and_blocks_no_other_probe(servers: ServerFarm):
    async def scenario() -> tuple[ProbeResult, ProbeResult, float, float]:
        prober: Prober[str] = Prober(lambda key: None, interval=60, timeout=FAST, limit=4)
        try:
            async with hung_server() as hung:
                began = time.monotonic()
                stuck = asyncio.create_task(prober.check(hung))
                healthy = await prober.check(url_of(servers))
                healthy_after = time.monotonic() - began
                return await stuck, healthy, healthy_after, time.monotonic() - began
        finally:
            await prober.close()

    stuck, healthy, healthy_after, stuck_after = asyncio.run(scenario())
    assert healthy.ready and healthy_after < 0.5
    assert (stuck.ready, stuck.reachable) == (False, False) and "no answer in time" in stuck.error
    assert stuck_after < 2


def test_serving_endpoint_flips_only_after_consecutive_failures(servers: ServerFarm):
    """Watched endpoints: probed at once, results published on change (and the owner told), a serving one
    survives single failures, and /v1/info is asked once per serving streak."""
    farm_url = url_of(servers)

    async def scenario() -> None:
        changes: list[str] = []
        prober: Prober[str] = Prober(changes.append, interval=0.05, failure_threshold=3, timeout=FAST)
        try:
            assert prober.watch("t", {"pod-a": farm_url}) == {"pod-a": NOT_PROBED}
            for _ in range(100):
                await asyncio.sleep(0.02)
                if prober.watch("t", {"pod-a": farm_url})["pod-a"].ready:
                    break
            assert prober.watch("t", {"pod-a": farm_url})["pod-a"].ready and changes == ["t"]
            endpoint = prober._endpoints["t"]["pod-a"]
            serving = endpoint.published
            assert endpoint.info is not None  # cached: later probes ask /readyz only
            for failures in (1, 2):
                assert not prober._record(endpoint, ProbeResult(ready=False, error="timeout"))
                assert endpoint.published == serving and endpoint.failures == failures
            assert prober._record(endpoint, ProbeResult(ready=False, error="timeout"))
            assert endpoint.published.error == "timeout" and endpoint.info is None
            prober.watch("t", {})
            assert prober.tracked == 0 and endpoint.task is not None
            await asyncio.sleep(0)
            assert endpoint.task.cancelled() or endpoint.task.done()
        finally:
            await prober.close()

    asyncio.run(scenario())


def test_many_hung_servers_leave_healthy_ones_ready(servers: ServerFarm):
    """More hung endpoints than probe slots: the healthy endpoint still turns ready within a few timeouts."""

    async def scenario() -> float:
        prober: Prober[str] = Prober(lambda key: None, interval=0.2, timeout=FAST, limit=8)
        try:
            async with hung_server() as hung:
                prober.watch("hung", {f"pod-{i}": f"{hung}/{i}" for i in range(40)})
                began = time.monotonic()
                while not prober.watch("ok", {"pod": url_of(servers)})["pod"].ready:
                    assert time.monotonic() - began < 10
                    await asyncio.sleep(0.05)
                return time.monotonic() - began
        finally:
            await prober.close()

    assert asyncio.run(scenario()) < 5
