"""Leader election on a coordination.k8s.io Lease, so that of several operator replicas exactly one acts.

The rules are client-go's: a candidate takes the Lease when nobody holds it or when the holder's record has
not changed for a whole lease duration as observed on the candidate's own clock (so clock skew between
nodes does not matter); every write carries the Lease's resourceVersion, so of two candidates racing only
one succeeds. The leader renews every retry period and gives up leadership the moment it has not renewed
for the renew deadline (no attempt runs past it), which is shorter than the lease: it stops acting before
anyone else may start. A
leader that stops cleanly stops renewing, then clears the holder, so the standby takes over at its next
retry.

`run(on_started_leading, on_stopped_leading)` is client-go's `RunOrDie`: it waits for the Lease, calls
`on_started_leading`, and renews; any other end, a lost Lease or any exception at all (while waiting or
renewing), calls `on_stopped_leading`, which must stop the acting (the operator exits at once and its pod
restarts as a standby). A renew loop that died while the acting went on would leave two replicas acting.
Cancelling `run` is the clean stop: renewing ends, then the Lease is released.
"""

import asyncio
import logging
import math
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from eagle3_operator.kube import LEASES, KubeApi, KubeError

logger = logging.getLogger(__name__)

LEASE_SECONDS = 15
RENEW_DEADLINE_SECONDS = 10.0
RETRY_SECONDS = 2.0


def micro_time(moment: datetime) -> str:
    """A Lease's MicroTime (RFC 3339 with microseconds)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(
        self,
        api: KubeApi,
        namespace: str,
        name: str,
        identity: str,
        *,
        lease_seconds: int = LEASE_SECONDS,
        renew_deadline: float = RENEW_DEADLINE_SECONDS,
        retry: float = RETRY_SECONDS,
    ) -> None:
        if not retry < renew_deadline < lease_seconds:
            raise ValueError("leader election needs retry < renew deadline < lease duration")
        self._api = api
        self.namespace, self.name, self.identity = namespace, name, identity
        self._lease_seconds = lease_seconds
        self._renew_deadline = renew_deadline
        self._retry = retry
        self._observed: tuple[Any, ...] | None = None  # the holder's record as last seen
        self._observed_at = 0.0  # when it was last seen to change (monotonic)
        self.leading = False

    async def acquire(self) -> float:
        """Wait until this candidate holds the Lease; return when the attempt that took it began (monotonic),
        the moment its renew deadline counts from."""
        logger.info("leader election: %s waits for Lease %s/%s", self.identity, self.namespace, self.name)
        while True:
            started = time.monotonic()
            if await self._try():
                break
            await asyncio.sleep(self._retry)
        self.leading = True
        logger.info("leader election: %s leads (Lease %s/%s)", self.identity, self.namespace, self.name)
        return started

    async def run(
        self, on_started_leading: Callable[[], None], on_stopped_leading: Callable[[], None]
    ) -> None:
        """Wait for the Lease, call `on_started_leading()`, renew. Any end but cancellation (the Lease lost,
        any exception) calls `on_stopped_leading()` at once: it must stop the acting (exit the process).
        Cancelled, it stops renewing, then releases the Lease, so a standby takes over at once."""
        try:
            taken = await self.acquire()
            on_started_leading()
            await self._renew(taken)
        except asyncio.CancelledError:
            await self.release()
            raise
        except Exception as error:  # whatever it is, this replica can no longer know it leads
            logger.error("leader election: %s stops: %s: %s", self.identity, type(error).__name__, error)
        self.leading = False
        on_stopped_leading()

    async def _renew(self, renewed: float) -> None:
        """Renew every retry period; return the moment the Lease has gone unrenewed for the renew deadline
        (counted from the start of the last attempt that took or renewed it, `renewed` at first). Every wait
        and every attempt is cut at that moment (client-go bounds its renewal by the deadline the same way),
        so however slowly the API server answers, this replica stops acting before another may take the
        Lease."""
        while True:
            deadline = renewed + self._renew_deadline
            await asyncio.sleep(min(self._retry, max(deadline - time.monotonic(), 0)))
            started = time.monotonic()
            if started < deadline and await self._try(deadline - started):
                renewed = started
            elif time.monotonic() >= deadline:
                logger.error("leader election: %s lost Lease %s/%s", self.identity, self.namespace, self.name)
                return

    async def release(self) -> None:
        """Clear the holder, so a standby takes over at once instead of after the lease runs out."""
        if not self.leading:
            return
        self.leading = False
        try:
            lease = await self._api.get_lease(self.namespace, self.name)
            if lease is not None and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                lease["spec"] = {**lease["spec"], "holderIdentity": None, "leaseDurationSeconds": 1}
                await self._api.write_lease(lease)
                logger.info(
                    "leader election: %s released Lease %s/%s", self.identity, self.namespace, self.name
                )
        except KubeError as error:  # the lease then simply runs out
            logger.warning("leader election: could not release the Lease: %s", error)

    async def _try(self, limit: float = math.inf) -> bool:
        """One attempt to take or renew the Lease, bounded in time (twice the retry period, or `limit` if
        less); failures are answers, not errors."""
        try:
            async with asyncio.timeout(min(self._retry * 2, limit)):
                return await self._take_or_renew()
        except (KubeError, TimeoutError) as error:
            logger.warning("leader election: %s", str(error) or "the API server did not answer in time")
            return False

    async def _take_or_renew(self) -> bool:
        now = micro_time(datetime.now(UTC))
        lease = await self._api.get_lease(self.namespace, self.name)
        created = lease is None
        if lease is None:
            lease = {"apiVersion": LEASES, "kind": "Lease", "metadata": {"name": self.name}, "spec": {}}
            lease["metadata"]["namespace"] = self.namespace
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        if holder and holder != self.identity:
            record = (holder, spec.get("renewTime"), spec.get("leaseTransitions"))
            if record != self._observed:
                self._observed, self._observed_at = record, time.monotonic()
            duration = spec.get("leaseDurationSeconds") or self._lease_seconds
            if time.monotonic() - self._observed_at < duration:
                return False  # held, and alive as far as this candidate can tell
        ours = holder == self.identity
        lease["spec"] = {
            **spec,
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self._lease_seconds,
            "acquireTime": spec.get("acquireTime") if ours else now,
            "renewTime": now,
            # Every new holder counts, after a clean release too (client-go); a new Lease starts at 0.
            "leaseTransitions": (spec.get("leaseTransitions") or 0) + (0 if ours or created else 1),
        }
        try:
            await self._api.write_lease(lease)
        except KubeError as error:
            if error.status == 409:  # someone else wrote it since this read: they won this round
                return False
            raise
        return True
