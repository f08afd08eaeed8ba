"""Ask target servers whether they serve, and what: GET /readyz, then GET /v1/info.

Probes are short (a slow server is reported as not ready, never waited for) and concurrent, and a global
limit keeps hundreds of targets from opening hundreds of sockets at once. One shared httpx client reuses
connections between rounds.
"""

import asyncio
from collections.abc import Mapping

import httpx
from eagle3_target.protocol import HydrationProgress, LoadProgress, TargetInfo
from pydantic import ValidationError

from eagle3_operator.status import ProbeResult

PROBE_TIMEOUT = httpx.Timeout(3.0, connect=1.0)
MAX_CONCURRENT_PROBES = 64
MAX_NOT_READY_BODY = 64 * 1024  # a loading server's 503 is a few hundred bytes; anything larger is not read


class Prober:
    def __init__(self, timeout: httpx.Timeout = PROBE_TIMEOUT, limit: int = MAX_CONCURRENT_PROBES) -> None:
        # trust_env=False: probes go to pod IPs directly, never through a proxy from the environment.
        self._client = httpx.AsyncClient(timeout=timeout, trust_env=False, follow_redirects=False)
        self._slots = asyncio.Semaphore(limit)

    async def close(self) -> None:
        await self._client.aclose()

    async def probe_many(
        self, addresses: Mapping[str, str], token: str | None = None
    ) -> dict[str, ProbeResult]:
        """Probe every address concurrently; keys are whatever the caller uses to name them (pod names)."""
        keys = list(addresses)
        results = await asyncio.gather(*(self.probe(addresses[key], token) for key in keys))
        return dict(zip(keys, results, strict=True))

    async def probe(self, base_url: str, token: str | None = None) -> ProbeResult:
        """`token` is the target's bearer token (spec.auth): /v1/info needs it, /readyz does not."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        base = base_url.rstrip("/")
        async with self._slots:
            try:
                ready = await self._client.get(f"{base}/readyz")
                if ready.status_code != 200:
                    return _not_ready(ready)
                info = await self._client.get(f"{base}/v1/info", headers=headers)
            except httpx.TransportError as error:
                return ProbeResult(ready=False, reachable=False, error=f"{type(error).__name__}: {error}")
            return _parse_info(info)

    async def hydration_progress(self, url: str) -> HydrationProgress | None:
        """What a running hydration pod says it has done; None when it does not answer (yet)."""
        async with self._slots:
            try:
                response = await self._client.get(url)
                return (
                    HydrationProgress.model_validate_json(response.content) if response.is_success else None
                )
            except (httpx.TransportError, ValidationError):
                return None


def _not_ready(response: httpx.Response) -> ProbeResult:
    """A /readyz refusal; a loading server's 503 also says how far its load has come (LoadProgress)."""
    error = f"/readyz answered {response.status_code}"
    if len(response.content) > MAX_NOT_READY_BODY:
        return ProbeResult(ready=False, error=error)
    try:
        progress = LoadProgress.model_validate(response.json()["loading"])
    except (ValueError, KeyError, TypeError):  # not our server's 503 (ValidationError is a ValueError)
        return ProbeResult(ready=False, error=error)
    return ProbeResult(ready=False, error=f"{error}: {progress.message}", progress=progress.message)


def _parse_info(response: httpx.Response) -> ProbeResult:
    if response.status_code != 200:
        return ProbeResult(ready=False, error=f"/v1/info answered {response.status_code}")
    try:
        info = TargetInfo.model_validate_json(response.content)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return ProbeResult(ready=False, error=f"/v1/info is not the expected JSON: {where}: {first['msg']}")
    return ProbeResult(ready=True, info=info.served_model())
