"""Probing target servers over real sockets: answers are parsed strictly, failures are told apart and never
raise, a hung or trickling server costs one deadline and blocks nobody else, bodies are capped, a serving
endpoint flips to not ready only after consecutive failures, and an external endpoint's status tells only
whether a target server answers there.

The servers are the target server's own app with a tiny model (ServerFarm) and raw sockets that accept
connections and never answer, trickle an answer a byte at a time, or answer with a huge body
(support.hostile_endpoints).
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import httpx
from eagle3_operator.probe import MAX_PROBE_BODY, NO_TARGET_SERVER, NOT_PROBED, Prober
from eagle3_operator.status.observation import ProbeResult
from eagle3_target.hydrate import ProgressTracker, serve_progress
from eagle3_target.protocol import HydrationProgress
from eagle3_target.server.app import create_app
from eagle3_target.server.settings import ServerSettings

from support.cluster.waiting import LOOPBACK, eventually, free_port
from support.hostile_endpoints import TRICKLE, HostileEndpoint
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


def test_ready_server_reports_its_model(servers: ServerFarm):
    expected = httpx.get(f"{url_of(servers)}/v1/info").json()
    result = asyncio.run(check(url_of(servers)))
    assert result.ready and result.reachable and result.error is None
    assert (result.info.fingerprint, result.info.num_hidden_layers) == (expected["fingerprint"], 8)
    assert result.info.name == "tiny-llama"


def test_a_server_reports_its_capture_set(servers: ServerFarm, tiny_llama_dir: Path):
    """status.model's captureLayerIds: the server's capture set in its order, else its aux layers."""
    default = eventually(
        lambda: asyncio.run(check(url_of(servers))).info, "the shared server's info", timeout=60
    )
    assert default.capture_layer_ids == [1, 3, 4]  # the default aux layers
    settings = ServerSettings(model=str(tiny_llama_dir), engine="hf", capture_layer_ids="7,1,3,0,4")
    with serve_in_thread(create_app(settings)) as url:

        def ready() -> ProbeResult | None:
            result = asyncio.run(check(url))
            return result if result.ready else None

        result = eventually(ready, "the capturing server to be ready", timeout=180)
    assert (result.info.aux_layer_ids, result.info.capture_layer_ids) == ([1, 3, 4], [7, 1, 3, 0, 4])


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


def test_a_followed_download_is_awaited_then_kept_while_silent_and_dropped_when_gone(tmp_path):
    """Until its first poll ends a download's progress is unknown (awaited), then it is what the pod last
    said, also once it falls silent; a pass is asked for at the first poll and when it moves."""
    tracker = ProgressTracker(tmp_path)
    tracker.plan([("model.safetensors", 2000), ("config.json", 5)])
    (tmp_path / "config.json").write_bytes(b"{}   ")
    server = serve_progress(tracker, port := free_port())
    url = f"http://{LOOPBACK}:{port}"

    async def scenario() -> None:
        asked: list[str] = []
        prober: Prober[str] = Prober(asked.append, interval=0.1)
        try:
            assert prober.follow_download("t", url) is None and prober.awaiting_download("t")
            await eventually_async(lambda: asked)
            assert not prober.awaiting_download("t")
            done = HydrationProgress(files_done=1, files_total=2, bytes_done=5, bytes_total=2005)
            assert prober.follow_download("t", url) == done
            server.shutdown()
            server.server_close()
            await asyncio.sleep(0.5)  # several silent polls
            assert prober.follow_download("t", url) == done
            assert prober.follow_download("t", None) is None and not prober.awaiting_download("t")
        finally:
            await prober.close()

    asyncio.run(scenario())


async def eventually_async(check: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


def test_bad_addresses_are_reported_not_raised():
    """An unbracketed IPv6 address is an invalid URL to httpx (not an HTTPError); it must not escape."""
    for url in ("http://fd00::5:8000", "http://[fd00::5]:99999", "ftp://127.0.0.1:1"):
        result = asyncio.run(check(url))
        assert not result.ready and result.error, url


def test_hung_server_costs_one_timeout_and_blocks_no_other_probe(servers: ServerFarm):
    async def scenario() -> tuple[ProbeResult, ProbeResult, float, float]:
        prober: Prober[str] = Prober(lambda key: None, interval=60, timeout=FAST, limit=4)
        try:
            with HostileEndpoint() as hung:
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
            with HostileEndpoint() as hung:
                prober.watch("hung", {f"pod-{i}": f"{hung}/{i}" for i in range(40)})
                began = time.monotonic()
                while not prober.watch("ok", {"pod": url_of(servers)})["pod"].ready:
                    assert time.monotonic() - began < 10
                    await asyncio.sleep(0.05)
                return time.monotonic() - began
        finally:
            await prober.close()

    assert asyncio.run(scenario()) < 5


def test_a_trickling_server_costs_one_deadline_and_a_huge_body_is_not_read():
    async def scenario() -> tuple[ProbeResult, float, ProbeResult, ProbeResult]:
        prober: Prober[str] = Prober(lambda key: None, interval=60, timeout=FAST, deadline=1.0)
        huge = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n" % (4 * MAX_PROBE_BODY)
        try:
            # Each byte comes within the read timeout, so only the total deadline ends the probe.
            with (
                HostileEndpoint(TRICKLE, pause=0.1) as trickling,
                HostileEndpoint(huge + b"{" * 4 * MAX_PROBE_BODY) as big,
            ):
                began = time.monotonic()
                slow = await prober.check(trickling)
                took = time.monotonic() - began
                headers = TRICKLE.split(b"\r\n\r\n")[0]
                with HostileEndpoint(headers + b"\r\n\r\n", pause=0.1) as trickled_headers:
                    return slow, took, await prober.check(trickled_headers), await prober.check(big)
        finally:
            await prober.close()

    slow, took, slow_headers, big = asyncio.run(scenario())
    assert (slow.ready, slow.reachable, slow.timed_out) == (False, False, True) and took < 2, (slow, took)
    assert "no answer in time" in slow.error and slow_headers.timed_out
    assert not big.ready and big.error == f"answered with more than {MAX_PROBE_BODY} bytes"


def test_a_hundred_trickling_endpoints_leave_a_new_healthy_one_its_first_verdict_in_one_period(
    servers: ServerFarm,
):
    """Trickling endpoints, once they have stalled a probe, are probed from their own small pool: a target
    created among them gets its first verdict at once, well within one probe period."""
    period = 3.0

    async def scenario() -> float:
        prober: Prober[str] = Prober(lambda key: None, interval=period, timeout=FAST, deadline=0.5, limit=8)
        try:
            with HostileEndpoint(TRICKLE, pause=0.1) as trickling:
                prober.watch("hostile", {f"e{i}": f"{trickling}/{i}" for i in range(100)})
                stalled = prober._endpoints["hostile"].values()
                began = time.monotonic()
                while not all(endpoint.stalled for endpoint in stalled):
                    assert time.monotonic() - began < 30
                    await asyncio.sleep(0.05)
                began = time.monotonic()
                while not prober.watch("ok", {"pod": url_of(servers)})["pod"].ready:
                    assert time.monotonic() - began < period
                    await asyncio.sleep(0.02)
                return time.monotonic() - began
        finally:
            await prober.close()

    assert asyncio.run(scenario()) < 1.0


def test_an_external_endpoint_tells_only_whether_a_target_server_answers(servers: ServerFarm):
    """Without disclosure, a closed port, a web server's 404, a hung socket and a trickle all read the
    same; a target server reads as it is."""
    not_found = b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\nnot found"

    async def scenario() -> dict[str, ProbeResult]:
        prober: Prober[str] = Prober(lambda key: None, interval=0.1, timeout=FAST, deadline=0.5)
        try:
            with HostileEndpoint(not_found) as web, HostileEndpoint() as hung:
                addresses = {
                    "closed": f"http://{LOOPBACK}:{free_port()}",
                    "web": web,
                    "hung": hung,
                    "target": url_of(servers),
                }
                for name, url in addresses.items():
                    prober.watch(name, {name: url}, disclose=False)
                began = time.monotonic()
                while True:
                    results = {
                        name: prober.watch(name, {name: url}, disclose=False)[name]
                        for name, url in addresses.items()
                    }
                    if all(result is not NOT_PROBED for result in results.values()):
                        return results
                    assert time.monotonic() - began < 10
                    await asyncio.sleep(0.05)
        finally:
            await prober.close()

    results = asyncio.run(scenario())
    assert results["target"].ready and results["target"].info is not None
    for name in ("closed", "web", "hung"):
        assert results[name] == ProbeResult(ready=False, reachable=False, error=NO_TARGET_SERVER), name


def test_reports_count_unknown_activity_and_leave_out_servers_that_do_not_serve(servers: ServerFarm):
    """The idle clock's evidence (review round 3, R2): an endpoint not probed yet or whose probe ran out of
    time is unknown (None, which keeps its target awake); one that answered that it does not serve (no
    server there) has nothing to count; a serving one reports when it was asked and answered."""

    async def scenario() -> tuple[list, list, datetime]:
        # One probe each (interval 60 s): room for the serving one to answer on a loaded machine; the
        # trickling one never ends, so it runs out of time whatever the deadline.
        prober: Prober[str] = Prober(lambda key: None, interval=60, timeout=httpx.Timeout(2.0), deadline=1.5)
        try:
            with HostileEndpoint(TRICKLE, pause=0.2) as stalling:
                before = datetime.now(UTC)
                endpoints = {"serving": url_of(servers), "stalling": stalling, "gone": f"http://{LOOPBACK}:1"}
                prober.watch("t", endpoints)
                unprobed = prober.reports("t")

                def settled() -> bool:
                    """Every endpoint has answered or run out of time (the stalling one: 1.5 s)."""
                    results = prober.watch("t", endpoints)
                    heard = results["stalling"].timed_out and results["gone"] is not NOT_PROBED
                    return heard and prober.reports("t")[0] is not None

                await eventually_async(settled)
                return unprobed, prober.reports("t"), before
        finally:
            await prober.close()

    unprobed, probed, before = asyncio.run(scenario())
    assert unprobed == [None, None, None]
    serving, stalling = probed
    assert stalling is None
    assert serving is not None and before <= serving.asked_at <= serving.answered_at <= datetime.now(UTC)


def test_asking_again_probes_at_once_and_asks_for_a_pass_when_answered(servers: ServerFarm):
    """The idle clock wants reports taken after its deadline: the prober does not wait out its period."""

    async def scenario() -> tuple[float, datetime, list]:
        passes: list[str] = []
        prober: Prober[str] = Prober(passes.append, interval=60, timeout=FAST)
        try:
            prober.watch("t", {"serving": url_of(servers)})
            await eventually_async(lambda: prober.reports("t") and prober.reports("t")[0])
            asked = len(passes)
            since = datetime.now(UTC)
            began = time.monotonic()
            prober.ask_again("t", since)
            await eventually_async(lambda: len(passes) > asked)
            took = time.monotonic() - began
            prober.ask_again("t", since)  # already answered since then: no new probe, no new pass
            await asyncio.sleep(0.3)
            return took, since, [len(passes) - asked, prober.reports("t")[0]]
        finally:
            await prober.close()

    took, since, (new_passes, report) = asyncio.run(scenario())
    assert took < 5 and new_passes == 1
    assert report is not None and report.asked_at >= since
