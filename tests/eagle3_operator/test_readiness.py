"""The operator's readiness endpoint over a real socket: 503 while the acting operator's kopf has not
started, 200 once it has, and 200 for a standby waiting for the Lease."""

import asyncio

import httpx
from eagle3_operator.readiness import Readiness

from support.cluster.waiting import LOOPBACK, free_port


def test_ready_as_a_standby_or_once_kopf_started():
    async def scenario() -> list[tuple[int, dict]]:
        port = free_port()
        seen = []
        async with (
            Readiness().serving(f"http://{LOOPBACK}:{port}/readyz") as readiness,
            httpx.AsyncClient(base_url=f"http://{LOOPBACK}:{port}") as client,
        ):

            async def answer() -> None:
                response = await client.get("/readyz")
                seen.append((response.status_code, response.json()))

            await answer()  # starting: neither standby nor leading
            readiness.standby = True
            await answer()
            readiness.standby, readiness.leading = False, True
            await answer()  # leading, kopf not started yet
            readiness.kopf_started.set()
            await answer()
        return seen

    assert asyncio.run(scenario()) == [
        (503, {"ready": False, "standby": False, "leading": False}),
        (200, {"ready": True, "standby": True, "leading": False}),
        (503, {"ready": False, "standby": False, "leading": True}),
        (200, {"ready": True, "standby": False, "leading": True}),
    ]
