"""Leader election on the real API server's Leases, in the shape of client-go's RunOrDie: acting starts only
once the Lease is held, any end of renewing or of waiting for it (an arbitrary exception included) stops it
before another replica can lead, and a clean stop (cancelling) stops renewing, then releases, so the
standby leads at its next retry.

Electors run in this process with short periods (lease 3 s, renew deadline 2 s, retry 0.3 s) and their own
API connections to the test control plane.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from eagle3_operator.kube import KubeApi
from eagle3_operator.leader import LeaderElector

from support.cluster.access import Cluster

LEASE, DEADLINE, RETRY = 3, 2.0, 0.3


@asynccontextmanager
async def connection(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeApi]:
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    api = await KubeApi.connect(10)
    try:
        yield api
    finally:
        await api.close()


def elector(api: KubeApi, namespace: str, identity: str) -> LeaderElector:
    return LeaderElector(
        api, namespace, "e3", identity, lease_seconds=LEASE, renew_deadline=DEADLINE, retry=RETRY
    )


def test_any_exception_in_renewing_stops_the_work_before_another_replica_leads(
    cluster, namespace, monkeypatch
):
    async def scenario() -> tuple[float, float, str]:
        async with connection(cluster, monkeypatch) as api_a, connection(cluster, monkeypatch) as api_b:
            a, b = elector(api_a, namespace, "a"), elector(api_b, namespace, "b")
            stopped: list[float] = []
            running = asyncio.create_task(a.run(lambda: None, lambda: stopped.append(time.monotonic())))
            while not a.leading:
                await asyncio.sleep(0.05)

            async def not_json(namespace: str, name: str) -> dict:
                raise ValueError("Expecting value: line 1 column 1 (char 0)")  # a 2xx that is not JSON

            api_a.get_lease = not_json  # type: ignore[method-assign]
            await b.acquire()
            led = time.monotonic()
            await running  # ended by the error, not by a cancel
            lease = await api_b.get_lease(namespace, "e3")
            assert lease is not None
            return stopped[0], led, lease["spec"]["holderIdentity"]

    stopped, led, holder = asyncio.run(scenario())
    assert stopped < led and holder == "b"


def test_a_clean_stop_releases_and_the_standby_leads_at_its_next_retry(cluster, namespace, monkeypatch):
    async def scenario() -> tuple[float, dict, dict]:
        async with connection(cluster, monkeypatch) as api_a, connection(cluster, monkeypatch) as api_b:
            a, b = elector(api_a, namespace, "a"), elector(api_b, namespace, "b")
            leading = asyncio.Event()

            def never() -> None:
                raise AssertionError("renewing ended by itself")

            running = asyncio.create_task(a.run(leading.set, never))
            await leading.wait()
            first = await api_a.get_lease(namespace, "e3")
            standby = asyncio.create_task(b.acquire())
            await asyncio.sleep(4 * RETRY)  # a few renewals, then a clean stop (a signal, say)
            running.cancel()
            with pytest.raises(asyncio.CancelledError):
                await running
            released = time.monotonic()
            await standby
            took = time.monotonic() - released
            await asyncio.sleep(3 * RETRY)  # a's renewing was stopped: it does not take the Lease back
            last = await api_b.get_lease(namespace, "e3")
            assert first is not None and last is not None
            return took, first["spec"], last["spec"]

    took, first, last = asyncio.run(scenario())
    assert took < RETRY + 1.0 < LEASE  # at the standby's next retry, not after the lease ran out
    assert first["holderIdentity"] == "a" and first["leaseTransitions"] == 0  # a new Lease
    assert last["holderIdentity"] == "b" and last["leaseTransitions"] == 1  # a new holder after a release
    assert last["renewTime"] >= last["acquireTime"]


def test_a_timed_out_attempt_says_so(cluster, namespace, monkeypatch, caplog):
    async def scenario() -> bool:
        async with connection(cluster, monkeypatch) as api:
            candidate = elector(api, namespace, "slow")

            async def hang(namespace: str, name: str) -> dict:
                await asyncio.sleep(60)
                return {}

            api.get_lease = hang  # type: ignore[method-assign]
            return await candidate._try()

    with caplog.at_level(logging.WARNING, logger="eagle3_operator.leader"):
        assert asyncio.run(scenario()) is False
    assert "leader election: the API server did not answer in time" in caplog.text


def test_an_error_while_waiting_for_the_lease_stops_the_replica_before_it_acts(
    cluster, namespace, monkeypatch
):
    """A standby whose wait for the Lease fails in an unexpected way must not start acting: it stops (the
    operator exits and restarts as a standby), and `on_started_leading` is never called."""

    async def scenario() -> tuple[list[str], bool]:
        async with connection(cluster, monkeypatch) as api_a, connection(cluster, monkeypatch) as api_b:
            a, b = elector(api_a, namespace, "a"), elector(api_b, namespace, "b")
            await a.acquire()
            calls: list[str] = []

            async def not_json(namespace: str, name: str) -> dict:
                raise ValueError("Expecting value: line 1 column 1 (char 0)")

            api_b.get_lease = not_json  # type: ignore[method-assign]
            await b.run(lambda: calls.append("started"), lambda: calls.append("stopped"))
            return calls, b.leading

    calls, leading = asyncio.run(scenario())
    assert calls == ["stopped"] and not leading


def test_a_leader_stops_acting_at_its_renew_deadline_however_slowly_the_api_server_answers(
    cluster, namespace, monkeypatch
):
    """Review round 3, R1 (the README's "exits before another replica may act"): a renewal lands but its
    answer takes almost an attempt's bound, then the API server answers no more. Acting must stop at the
    renew deadline counted from that attempt, not one attempt later (the standby may lead a lease after it
    saw the renewal)."""

    async def scenario() -> tuple[float, float]:
        async with connection(cluster, monkeypatch) as api:
            leader = elector(api, namespace, "a")
            stopped: list[float] = []
            running = asyncio.create_task(leader.run(lambda: None, lambda: stopped.append(time.monotonic())))
            while not leader.leading:
                await asyncio.sleep(0.05)
            real_get, real_write = api.get_lease, api.write_lease
            attempts: list[float] = []

            async def get_then_stall(namespace: str, name: str) -> dict | None:
                attempts.append(time.monotonic())
                if len(attempts) > 1:
                    await asyncio.sleep(3600)  # cut off from the API server
                return await real_get(namespace, name)

            async def land_then_answer_late(lease: dict) -> dict:
                written = await real_write(lease)
                await asyncio.sleep(2 * RETRY - 0.05)  # just inside the attempt's bound: it renewed
                return written

            api.get_lease = get_then_stall  # type: ignore[method-assign]
            api.write_lease = land_then_answer_late  # type: ignore[method-assign]
            await running
            return attempts[0], stopped[0]

    renewing_began, stopped = asyncio.run(scenario())
    assert stopped - renewing_began <= DEADLINE + 0.15, stopped - renewing_began
    assert stopped - renewing_began < LEASE
