"""Ask target servers whether they serve, and what (GET /readyz, then GET /v1/info), apart from reconciles.

Probing runs in its own tasks with its own concurrency bound, so a slow or hung server costs only a probe
slot for one deadline and never holds a reconcile worker. Each GET has a total deadline (connect, headers
and body together) and reads at most a capped body, so an endpoint that trickles bytes costs as much as one
that never answers; an endpoint whose last probe ran out of time is probed from a small pool of its own,
so endpoints that stall cannot take the slots of the ones that answer. Every tracked endpoint is probed on
its own jittered period; the reconcile pass only reads the latest published result and is asked for again
when a result changes. A serving endpoint is published as not ready only after `failure_threshold`
consecutive failed probes (one slow answer under a heavy batch does not flip it); an endpoint that never
served is published as the probe finds it, so its error shows at once. /v1/info is immutable for a
server's lifetime, so it is fetched once per serving streak and only /readyz is asked after that; its body
also says who pulled lately (protocol.Activity), kept with the result, stamped with when it was asked and
answered, for the idle clock (status/idle.py), which may ask for every endpoint of a target to be probed at
once (`ask_again`) rather than decide on a report older than its deadline. A running download (a hydration
pod) is polled for its progress the same way, so status moves while it runs.

Probes carry no credentials: /readyz and /v1/info answer without the token (the data routes do not), so
nothing a resource's author writes can make the operator send a secret anywhere. An external endpoint
(`spec.endpoint.url`, which anyone who may create a target writes) is watched without disclosure: unless a
target server answers there, status says only that none does, never what answered (a status code, a
refused connection or a timeout would make the operator's network position a port scanner); the operator's
log has the detail.
"""

import asyncio
import contextlib
import dataclasses
import json
import logging
import random
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Generic, TypeVar

import httpx
from eagle3_target.protocol import Activity, HydrationProgress, LoadProgress, ServedModel, TargetInfo
from pydantic import ValidationError

from eagle3_operator import metrics
from eagle3_operator.status.observation import NOT_PROBED_YET, ActivityReport, ProbeResult

logger = logging.getLogger(__name__)
K = TypeVar("K", bound=Hashable)

PROBE_TIMEOUT = httpx.Timeout(3.0, connect=1.0)
# One GET, connect to last body byte: what PROBE_TIMEOUT bounds per read, for the whole request.
PROBE_DEADLINE_S = 5.0
MAX_CONCURRENT_PROBES = 64
# Endpoints whose last probe got no answer share this many slots, apart from the others.
MAX_CONCURRENT_STALLED_PROBES = 8
# The most a probe reads of a body: /readyz's 503 and /v1/info are a few hundred bytes each.
MAX_PROBE_BODY = 64 * 1024
NO_TARGET_SERVER = "no target server answers there"
FAILURE_THRESHOLD = 3
JITTER = 0.1  # each period is interval × (1 ± JITTER), so endpoints tracked together drift apart
NOT_PROBED = ProbeResult(ready=False, error=NOT_PROBED_YET)


class _BodyTooLarge(Exception):
    """A probed body beyond MAX_PROBE_BODY: not a target server's answer."""


@dataclass
class _Endpoint:
    url: str
    disclose: bool = (
        True  # publish what answered; an external endpoint publishes only "a target server or not"
    )
    published: ProbeResult = NOT_PROBED
    stalled: bool = False  # its last probe ran out of time: the next one waits for a stalled slot
    failures: int = 0  # consecutive failed probes
    info: ServedModel | None = None  # /v1/info of the current serving streak
    started: datetime | None = None  # when its latest probe began
    # A report asked for at or after this is wanted (ask_again): each probe that began since then asks for
    # a pass, until one brings a report or the endpoint is published as not serving.
    wanted_after: datetime | None = None
    hurry: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # probe now, not after a period
    task: asyncio.Task[None] | None = field(default=None, repr=False)


@dataclass
class _Download:
    url: str
    progress: HydrationProgress | None = None  # its last answer (kept while it is silent)
    polled: bool = False  # its first poll has ended, answered or not
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class Prober(Generic[K]):
    """Tracks endpoints and downloads per owner key (a target) and calls `on_change(key)` when a published
    result or a download's progress moves."""

    def __init__(
        self,
        on_change: Callable[[K], None],
        *,
        interval: float,
        failure_threshold: int = FAILURE_THRESHOLD,
        timeout: httpx.Timeout = PROBE_TIMEOUT,
        deadline: float = PROBE_DEADLINE_S,
        limit: int = MAX_CONCURRENT_PROBES,
        stalled_limit: int = MAX_CONCURRENT_STALLED_PROBES,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        # trust_env=False: probes go to pod IPs directly, never through a proxy from the environment.
        self._client = httpx.AsyncClient(timeout=timeout, trust_env=False, follow_redirects=False)
        self._deadline = deadline
        self._slots = asyncio.Semaphore(limit)
        self._stalled_slots = asyncio.Semaphore(stalled_limit)
        self._on_change = on_change
        self._interval = interval
        self._threshold = failure_threshold
        self._clock = clock
        self._endpoints: dict[K, dict[str, _Endpoint]] = {}
        self._downloads: dict[K, _Download] = {}

    @property
    def tracked(self) -> int:
        """How many endpoints are being probed (the operator's liveness detail)."""
        return sum(len(endpoints) for endpoints in self._endpoints.values())

    def watch(self, key: K, addresses: Mapping[str, str], *, disclose: bool = True) -> dict[str, ProbeResult]:
        """Probe exactly these endpoints (name → base URL) for `key` from now on; return their latest results.

        New endpoints are probed at once and read NOT_PROBED until then; endpoints no longer listed stop.
        Without `disclose` (endpoints a resource's author chose), a result that is not a target server's
        answer is published as NO_TARGET_SERVER only.
        """
        endpoints = self._endpoints.setdefault(key, {})
        for name in [n for n, e in endpoints.items() if addresses.get(n) != e.url]:
            self._stop(endpoints.pop(name))
        for name, url in addresses.items():
            if name not in endpoints:
                endpoint = endpoints[name] = _Endpoint(url.rstrip("/"), disclose)
                endpoint.task = asyncio.create_task(self._run(key, endpoint), name=f"probe {url}")
        if not endpoints:
            del self._endpoints[key]
        return {name: endpoint.published for name, endpoint in endpoints.items()}

    def follow_download(self, key: K, url: str | None) -> HydrationProgress | None:
        """Poll this progress URL of `key`'s running download from now on (None: there is none); return
        what it last said (None until it answers; `awaiting_download` tells whether it was asked yet)."""
        download = self._downloads.get(key)
        if download is not None and download.url != url:
            self._stop(self._downloads.pop(key))
            download = None
        if url is None:
            return None
        if download is None:
            download = self._downloads[key] = _Download(url)
            download.task = asyncio.create_task(self._follow(key, download), name=f"progress {url}")
        return download.progress

    def awaiting_download(self, key: K) -> bool:
        """Whether `key`'s download is followed and its first poll has not ended: its progress is unknown
        yet, not absent."""
        download = self._downloads.get(key)
        return download is not None and not download.polled

    def reports(self, key: K) -> list[ActivityReport | None]:
        """What each of `key`'s endpoints whose activity counts said of its data requests at its last answer:
        a serving endpoint's report (None if it did not say), and None for one not probed yet or whose
        probes run out of time (unknown, which keeps a target awake). An endpoint that answered that it does
        not serve (loading, refused) has no data requests to count."""
        endpoints = self._endpoints.get(key, {}).values()
        return [
            endpoint.published.activity if endpoint.published.ready else None
            for endpoint in endpoints
            if endpoint.published.ready or endpoint.published is NOT_PROBED or endpoint.stalled
        ]

    def ask_again(self, key: K, since: datetime) -> None:
        """Probe now every endpoint of `key` whose latest probe began before `since`, and ask for a pass
        once each has answered: the idle clock wants reports taken at or after its deadline."""
        for endpoint in self._endpoints.get(key, {}).values():
            endpoint.wanted_after = since
            if endpoint.started is None or endpoint.started < since:
                endpoint.hurry.set()

    def forget(self, key: K) -> None:
        for endpoint in self._endpoints.pop(key, {}).values():
            self._stop(endpoint)
        download = self._downloads.pop(key, None)
        if download is not None:
            self._stop(download)

    async def close(self) -> None:
        for key in {*self._endpoints, *self._downloads}:
            self.forget(key)
        await self._client.aclose()

    async def check(
        self, base_url: str, info: ServedModel | None = None, *, stalled: bool = False
    ) -> ProbeResult:
        """One probe, never raising: /readyz, then /v1/info unless `info` is already known for this server.
        A `stalled` endpoint (its last probe ran out of time) waits for a slot of its own pool."""
        async with self._stalled_slots if stalled else self._slots:
            try:
                asked_at = self._clock()
                status, body = await self._get(f"{base_url}/readyz")
                answered_at = self._clock()
                if status != 200:
                    result = _not_ready(status, body)
                elif info is not None:
                    result = ProbeResult(ready=True, info=info)
                else:
                    result = _parse_info(*await self._get(f"{base_url}/v1/info"))
                if result.ready:
                    activity = _activity(body)
                    report = None if activity is None else ActivityReport(activity, asked_at, answered_at)
                    result = dataclasses.replace(result, activity=report)
            except (TimeoutError, httpx.TimeoutException) as error:
                error_text = f"no answer in time ({_name(error)})"
                result = ProbeResult(ready=False, reachable=False, error=error_text, timed_out=True)
            except _BodyTooLarge:
                result = ProbeResult(ready=False, error=f"answered with more than {MAX_PROBE_BODY} bytes")
            except Exception as error:  # every failure is a result, never an escape:
                # httpx's InvalidURL and StreamError are no HTTPErrors, and its connect path lets OSError,
                # or an ExceptionGroup around OverflowError (a port > 65535), through.
                result = ProbeResult(ready=False, reachable=False, error=f"{_name(error)}: {error}")
        metrics.PROBES.labels(outcome="ready" if result.ready else "not_ready").inc()
        return result

    async def _get(self, url: str) -> tuple[int, bytes]:
        """One GET's status and body, within the deadline and the body cap (TimeoutError, _BodyTooLarge)."""
        async with asyncio.timeout(self._deadline), self._client.stream("GET", url) as response:
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > MAX_PROBE_BODY:
                    raise _BodyTooLarge
            return response.status_code, bytes(body)

    async def hydration_progress(self, url: str) -> HydrationProgress | None:
        """What a running hydration pod says it has done; None when it does not answer (yet)."""
        async with self._slots:
            try:
                status, body = await self._get(url)
                return HydrationProgress.model_validate_json(body) if 200 <= status < 300 else None
            except Exception:  # silence, like any failure in `check` (httpx lets OSError and more through)
                return None

    async def _run(self, key: K, endpoint: _Endpoint) -> None:
        while True:
            endpoint.hurry.clear()
            endpoint.started = self._clock()
            try:
                result = await self.check(endpoint.url, endpoint.info, stalled=endpoint.stalled)
            except Exception as error:  # a bug must not end this endpoint's probing silently
                logger.exception("probe of %s failed", endpoint.url)
                result = ProbeResult(ready=False, error=f"probe failed: {_name(error)}")
            endpoint.stalled = result.timed_out
            if not endpoint.disclose and not _from_a_target_server(result):
                logger.info("probe of %s: %s", endpoint.url, result.error)
                result = ProbeResult(ready=False, reachable=False, error=NO_TARGET_SERVER)
            changed = self._record(endpoint, result)
            if changed or self._brought_wanted(endpoint):
                self._on_change(key)
            await self._pause(endpoint.hurry)

    async def _follow(self, key: K, download: _Download) -> None:
        while True:
            progress = await self.hydration_progress(download.url)
            first = not download.polled
            download.polled = True
            if progress is not None and progress != download.progress:
                download.progress = progress
                self._on_change(key)
            elif first:
                self._on_change(key)  # the pass holding the stored status for it may go on
            await self._pause()

    async def _pause(self, hurry: asyncio.Event | None = None) -> None:
        """The wait between two probes of one endpoint (cut short by `hurry`), or two polls of a download."""
        period = self._interval * random.uniform(1 - JITTER, 1 + JITTER)
        if hurry is None:
            await asyncio.sleep(period)
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(period):
                await hurry.wait()

    @staticmethod
    def _brought_wanted(endpoint: _Endpoint) -> bool:
        """Whether the probe just ended began after a report was wanted (ask_again): the pass that wanted it
        may decide now. The want stays until a report comes or the endpoint no longer serves."""
        wanted = endpoint.wanted_after
        if wanted is None or endpoint.started is None or endpoint.started < wanted:
            return False
        report = endpoint.published.activity
        if not endpoint.published.ready or (report is not None and report.asked_at >= wanted):
            endpoint.wanted_after = None
        return True

    def _record(self, endpoint: _Endpoint, result: ProbeResult) -> bool:
        """Apply one probe's result with hysteresis; whether the published result changed."""
        if result.ready:
            endpoint.failures, endpoint.info = 0, result.info
            published = result
        else:
            endpoint.failures += 1
            endpoint.info = None
            holding = endpoint.published.ready and endpoint.failures < self._threshold
            published = endpoint.published if holding else result
        changed = published != endpoint.published or _consumers(published) != _consumers(endpoint.published)
        endpoint.published = published
        return changed

    @staticmethod
    def _stop(tracked: _Endpoint | _Download) -> None:
        if tracked.task is not None:
            tracked.task.cancel()


def _name(error: BaseException) -> str:
    return type(error).__name__


def _from_a_target_server(result: ProbeResult) -> bool:
    """Whether a target server gave this result: it serves, or it said how far its load has come."""
    return result.ready or result.progress is not None


def _consumers(result: ProbeResult) -> tuple[int, set[str]]:
    """How many clients a result counts, and their ids where listed: a new or vanished one asks for a pass (a
    new request alone does not)."""
    if result.activity is None:
        return 0, set()
    activity = result.activity.activity
    return activity.active_clients, {client.id for client in activity.clients}


def _activity(body: bytes) -> Activity | None:
    """The data-request activity in a ready server's /readyz body (None: it does not say)."""
    try:
        return Activity.model_validate(json.loads(body)["activity"])
    except (ValueError, KeyError, TypeError):
        return None


def _not_ready(status: int, body: bytes) -> ProbeResult:
    """A /readyz refusal; a loading server's 503 also says how far its load has come (LoadProgress)."""
    error = f"/readyz answered {status}"
    try:
        progress = LoadProgress.model_validate(json.loads(body)["loading"])
    except (ValueError, KeyError, TypeError):  # not our server's 503 (ValidationError is a ValueError)
        return ProbeResult(ready=False, error=error)
    return ProbeResult(ready=False, error=f"{error}: {progress.message}", progress=progress.message)


def _parse_info(status: int, body: bytes) -> ProbeResult:
    if status != 200:
        return ProbeResult(ready=False, error=f"/v1/info answered {status}")
    try:
        info = TargetInfo.model_validate_json(body)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return ProbeResult(ready=False, error=f"/v1/info is not the expected JSON: {where}: {first['msg']}")
    return ProbeResult(ready=True, info=info.served_model())
