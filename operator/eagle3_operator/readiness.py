"""The operator's readiness endpoint (`--readiness`, /readyz): whether this replica is doing its job.

A standby waiting for the Lease is ready (waiting is its job, and a rollout must be able to continue past
it); the acting operator is ready once kopf has started: its startup handlers built the reconciler over the
indexes and the watches run (kopf delivers no event before every index is listed). Before that, 503.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

from aiohttp import web


class Readiness:
    def __init__(self) -> None:
        self.standby = False
        self.leading = False
        # Handed to kopf.operator(ready_flag=...): kopf sets it once its startup handlers have run.
        self.kopf_started = asyncio.Event()

    @property
    def ready(self) -> bool:
        return self.standby or (self.leading and self.kopf_started.is_set())

    async def _answer(self, _: web.Request) -> web.Response:
        state = {"ready": self.ready, "standby": self.standby, "leading": self.leading}
        return web.json_response(state, status=200 if self.ready else 503)

    @contextlib.asynccontextmanager
    async def serving(self, url: str) -> AsyncIterator["Readiness"]:
        """Answer URL (e.g. http://0.0.0.0:8082/readyz) while inside; an empty URL serves nothing."""
        if not url:
            yield self
            return
        parts = urlsplit(url)
        app = web.Application()
        app.router.add_get(parts.path or "/", self._answer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, parts.hostname, parts.port or 80, reuse_address=True).start()
        try:
            yield self
        finally:
            await runner.cleanup()
