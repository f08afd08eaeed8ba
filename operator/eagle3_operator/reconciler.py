"""One level-based reconcile per target: children in place, probe results read, status written on change.

Every trigger (the target changed, a child or pod changed, a probe result or a download's progress moved) just
asks for a pass over one target, through one work queue (workqueue.py): requests that arrive while a pass runs
fold into a single follow-up pass, and each pass returns when it wants to run again (a startup deadline, the
end of a refused apply's backoff, the end of a wait for first probe verdicts, the end of an idle window), so
the queue holds every timer and retry there is. A pass reads only in-memory state (kopf's indexes of the
target, its children and its pods, see indexes.py, and the prober's latest results), so it makes API calls
only to change something: a child that differs from what is rendered (or is missing, or should not exist) is
applied or deleted (child_applier.py), and the status is patched with just the keys that changed. Probing
never happens inside a pass (probe.py), so a hung server cannot hold a reconcile worker.
"""

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from eagle3_operator import metrics
from eagle3_operator.child_applier import ChildApplier, ChildWrites, apply_failure
from eagle3_operator.constants import HYDRATION_PROGRESS_PORT, LABEL_INSTANCE, POD_MONITOR_API_VERSION
from eagle3_operator.indexes import ChildState, TargetKey, TargetSnapshot, only
from eagle3_operator.kube import DISCOVERY_TTL_SECONDS, KubeApi, KubeError, NameConflict, TargetRef
from eagle3_operator.probe import PROBE_DEADLINE_S, Prober
from eagle3_operator.render.children import build_children, rendered_digest
from eagle3_operator.render.hydration import hydration_job_name
from eagle3_operator.render.model_source import hf_revision
from eagle3_operator.render.names import label_selector, selector_labels
from eagle3_operator.render.network import Neighbours, service_url
from eagle3_operator.render.server_command import model_identity, server_args
from eagle3_operator.render.server_image import DEFAULT_IMAGES, ImagePin, ServerImages, pin_image
from eagle3_operator.spec import Eagle3TargetSpec, InvalidSpec, unknown_fields
from eagle3_operator.status.conditions import Transition, transitions
from eagle3_operator.status.document import compute_status, status_patch
from eagle3_operator.status.idle import IdleJudgement, judge_idle, wake_pending_since
from eagle3_operator.status.observation import (
    EPOCH,
    Failure,
    Hydration,
    JobView,
    Observation,
    PodView,
    endpoint_address,
)
from eagle3_operator.status.observe import deployment_view, describe_progress, hydration_state
from eagle3_operator.workqueue import WorkQueue

logger = logging.getLogger(__name__)

MAX_CONCURRENT_RECONCILES = 32
# How often a target that wants a PodMonitor looks for prometheus-operator's API while it is not served.
MONITOR_RECHECK_SECONDS = 15.0
# The longest the stored status stands for endpoints not probed yet. A first probe ends within its deadline
# once it has a slot, but after a restart every endpoint wants one at once, and each endpoint that stalls
# holds a slot for a whole deadline: 6 deadlines cover the first verdicts of some 300 stalling endpoints
# (MAX_CONCURRENT_PROBES per deadline) before the healthy ones'.
FIRST_VERDICT_WAIT_SECONDS = 6 * PROBE_DEADLINE_S


@dataclass
class _Memory:
    """What the reconciler remembers about one target between passes (lost on restart, rebuilt by a pass)."""

    uid: str = ""
    written_status: dict[str, Any] | None = None
    written_version: str | None = None
    # Target resourceVersions that this operator's own status writes have superseded: while the index shows
    # one of them, it has not caught up with the last write, and the written status stands in for the stored.
    superseded: set[str] = field(default_factory=set)
    generation: int = 0  # of the last pass
    children: ChildWrites = field(default_factory=ChildWrites)  # what this process's applies left
    unknown: tuple[str, ...] = ()  # spec fields this operator does not know, already warned about
    pin: ImagePin = field(default_factory=ImagePin)  # the server image of the last rendering
    # Since when (the work queue's clock) the stored status has stood for endpoints not probed yet.
    holding_since: float | None = None


@dataclass
class Pass:
    """What one pass did (its result label for metrics: ok, invalid_spec, apply_refused, gone) and when it
    wants to run again (seconds; None: only when something changes)."""

    result: str
    requeue_after: float | None = None

    def again_within(self, delay: float) -> None:
        """Run again at the latest after `delay` (the earliest of what the pass's parts ask for)."""
        self.requeue_after = delay if self.requeue_after is None else min(self.requeue_after, delay)


class Reconciler:
    def __init__(
        self,
        api: KubeApi,
        *,
        targets: Mapping[TargetKey, Iterable[TargetSnapshot]],
        children: Iterable[Mapping[TargetKey, Iterable[ChildState]]],
        pods: Mapping[TargetKey, Iterable[PodView]],
        neighbours: Neighbours | None = None,
        probe_interval: float,
        server_images: ServerImages = DEFAULT_IMAGES,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        """`targets`, `children` and `pods` are kopf indexes (key → the values indexed under it);
        `server_images` are what new targets without spec.image run. Passes run once `start()` is called."""
        self._api = api
        self._neighbours = neighbours or Neighbours()
        self._server_images = server_images
        self._prober: Prober[TargetKey] = Prober(self.request, interval=probe_interval, clock=clock)
        self._targets = targets
        self._children = ChildApplier(api, children)
        self._pods = pods
        self._clock = clock
        self._memory: dict[TargetKey, _Memory] = {}
        self._queue: WorkQueue[TargetKey] = WorkQueue(
            self._pass,
            concurrency=MAX_CONCURRENT_RECONCILES,
            expected_errors=(KubeError, OSError),
            name="reconcile",
        )
        self._instances: dict[TargetKey, str] = {}  # (namespace, pod instance label) -> target name
        self._published: dict[TargetKey, tuple[str, int]] = {}  # what the target gauges count: phase, ready
        self._series = metrics.TargetSeries(clock)  # each target's condition and wake gauges

    def request(self, key: TargetKey) -> None:
        """Ask for a pass over one target; cheap, never blocks, coalesces with a pass already queued."""
        self._queue.add(key)

    def start(self) -> None:
        """Run passes from now on (until then requests only queue: a standby's warm indexes fill the queue,
        and winning the Lease starts it)."""
        self._queue.start()

    def request_instance(self, namespace: str, instance: str) -> None:
        """Ask for a pass over the target whose pods carry this instance label (pods have no owner link)."""
        name = self._instances.get((namespace, instance))
        if name is not None:
            self.request((namespace, name))

    @property
    def known_targets(self) -> int:
        return len(self._memory)

    def is_own_write(self, key: TargetKey, resource_version: str, generation: int) -> bool:
        """Whether a target event is only the echo of the status this reconciler just wrote (a relisted
        event can carry that resourceVersion and a spec change both: the generation tells)."""
        memory = self._memory.get(key)
        return (
            memory is not None
            and memory.written_version == resource_version
            and memory.generation == generation
        )

    @property
    def probed_endpoints(self) -> int:
        return self._prober.tracked

    async def close(self) -> None:
        """Stop in order: passes first (no new ones, running ones finished), then probing."""
        await self._queue.shutdown()
        await self._prober.close()

    async def _pass(self, key: TargetKey) -> float | None:
        """The work queue's unit: one pass, counted; a pass that raises is retried by the queue."""
        started = time.monotonic()
        result = "error"
        try:
            outcome = await self.reconcile(key)
            result = outcome.result
            return outcome.requeue_after
        finally:
            metrics.RECONCILES.labels(result=result).inc()
            metrics.RECONCILE_DURATION.observe(time.monotonic() - started)

    async def reconcile(self, key: TargetKey) -> Pass:
        """One pass over one target."""
        snapshot = only(self._targets.get(key))
        if snapshot is None or snapshot.deleting:
            self._forget(key)  # Deleted: owner references let the garbage collector remove the children.
            return Pass("gone")
        memory = self._memory.get(key)
        if memory is None or memory.uid != snapshot.uid:  # new, or deleted and created again under the name
            memory = self._memory[key] = _Memory(uid=snapshot.uid)
        namespace, name = key
        self._instances[namespace, selector_labels(name)[LABEL_INSTANCE]] = name
        memory.generation = snapshot.generation
        outcome = Pass("ok")
        lagging = memory.written_status is not None and snapshot.resource_version in memory.superseded
        if not lagging:  # The index shows the last write, or a later write by someone else: trust it.
            memory.superseded.clear()
        previous = (
            memory.written_status if lagging and memory.written_status is not None else dict(snapshot.status)
        )
        try:
            spec = Eagle3TargetSpec.parse(dict(snapshot.spec))
        except InvalidSpec as error:
            self._prober.forget(key)  # nothing to probe or follow until the spec is fixed
            observation = Observation(generation=snapshot.generation, spec=None, spec_error=str(error))
        else:
            await self._warn_unknown_fields(key, snapshot, memory)
            idle = judge_idle(spec, snapshot.wake, previous, self._prober.reports(key), self._clock())
            if idle.recheck_in is not None:
                outcome.again_within(idle.recheck_in)
            if idle.reports_wanted_after is not None:  # the prober asks for a pass once they have answered
                self._prober.ask_again(key, idle.reports_wanted_after)
            # Pods go only once status.idle is stored: resolve() never hands out endpoints of a target
            # that is scaling down (it wakes the target instead, and the wake keeps the pods).
            scale_to_zero = idle.idle is not None and bool(previous.get("idle"))
            if idle.idle is not None and not scale_to_zero:
                outcome.again_within(0)
            applied, refused = await self._sync_children(key, snapshot, spec, memory, outcome, scale_to_zero)
            observation = self._observe(key, snapshot, spec, memory, applied, refused, idle)
        deadline = self._next_startup_deadline(observation)
        if deadline is not None:
            outcome.again_within(deadline)
        hold = self._stored_status_hold(snapshot, memory, observation)
        if hold is not None:
            outcome.again_within(hold)
            return outcome
        status = compute_status(observation, previous, self._clock())
        patch = status_patch(previous, status)
        if patch:
            ready = next(c for c in status["conditions"] if c["type"] == "Ready")
            logger.info(
                "%s/%s: %s, Ready=%s (%s); writing %s",
                namespace,
                name,
                status["phase"],
                ready["status"],
                ready["reason"],
                ", ".join(sorted(patch)),
            )
            response = await self._api.patch_status(namespace, name, patch)
            metrics.STATUS_WRITES.inc()
            memory.written_status = status
            memory.superseded |= {snapshot.resource_version, memory.written_version or ""}
            memory.written_version = (response.get("metadata") or {}).get("resourceVersion")
            await self._announce(TargetRef(namespace, name, snapshot.uid), previous, status)
            if "idle" in patch:
                (metrics.IDLE_SCALE_DOWNS if status.get("idle") else metrics.WAKE_UPS).inc()
        if observation.apply_failure is None:
            self._queue.forget(key)
        self._published[key] = (status["phase"], status.get("readyReplicas") or 0)
        metrics.publish_targets(self._published.values())
        self._series.publish(key, status["conditions"], wake_pending_since(snapshot.wake, status))
        if observation.spec is None:
            outcome.result = "invalid_spec"
        elif observation.apply_failure is not None:
            outcome.result = "apply_refused"
        return outcome

    def _stored_status_hold(
        self, snapshot: TargetSnapshot, memory: _Memory, observation: Observation
    ) -> float | None:
        """How much longer this pass leaves the stored status as it is (None: it does not): some endpoint
        has no probe verdict yet and the status already says something (an operator restart, a takeover,
        a new pod). Not probed is unknown, not failed: writing now would flip a serving target to not
        Ready, drop its model and post events, all taken back a probe later. The prober asks for a pass
        at each first verdict; the wait is bounded by FIRST_VERDICT_WAIT_SECONDS, after which the pass
        writes what it knows."""
        if not observation.awaiting_verdicts or not (snapshot.status or {}).get("conditions"):
            memory.holding_since = None
            return None
        now = self._queue.now()
        if memory.holding_since is None:
            memory.holding_since = now
        left = memory.holding_since + FIRST_VERDICT_WAIT_SECONDS - now
        if left <= 0:
            memory.holding_since = None
            return None
        return left

    async def _sync_children(
        self,
        key: TargetKey,
        snapshot: TargetSnapshot,
        spec: Eagle3TargetSpec,
        memory: _Memory,
        outcome: Pass,
        idle: bool,
    ) -> tuple[dict[str, dict[str, Any]], Failure | None]:
        """Apply what differs from the rendering, delete what should not exist.

        Returns what was applied, and why applying failed if it did: every refusal (admission, quota,
        RBAC, conflicts, 5xx, no answer) or a name taken by someone else is reported in status, and not
        tried again before its backoff delay (the pass asks to run again then) unless the rendering
        changes.
        """
        namespace, name = key
        writes = memory.children
        digests: tuple[str, ...] = ()
        now = self._queue.now()
        try:
            monitors = await self._pod_monitors_served(spec, outcome)
            owned = self._children.owned(key)
            deployment = next(
                (c.essence for c in owned if c.kind == "Deployment" and c.owner_uid == snapshot.uid), None
            )
            pin = memory.pin = pin_image(deployment, snapshot.upgrade, self._server_images, spec.engine)
            job_name = hydration_job_name(name, spec, pin)
            job = self._hydration_job(key, job_name)
            hydrated = job_name is None or (job is not None and job.complete)
            desired = build_children(
                name,
                namespace,
                snapshot.uid,
                spec,
                pod_monitor_supported=monitors,
                neighbours=self._neighbours,
                hydrated=hydrated,
                idle=idle,
                pin=pin,
            )
            digests = tuple(rendered_digest(manifest) or "" for manifest in desired)
            held = writes.still_refused(digests, now)
            if held is not None:
                failure, retry_at = held
                outcome.again_within(retry_at - now)
                return {}, failure
            applied = await self._children.apply(
                key, snapshot.uid, desired, writes, monitors=monitors, hydrated=hydrated
            )
        except (KubeError, NameConflict) as error:
            failure = apply_failure(error)
            delay = self._queue.backoff(key)
            writes.refuse(digests, failure, retry_at=now + delay)
            outcome.again_within(delay)
            logger.warning("%s/%s: %s; trying again in %.0fs", namespace, name, failure.message, delay)
            return {}, failure
        writes.refused = None
        return applied, None

    async def _pod_monitors_served(self, spec: Eagle3TargetSpec, outcome: Pass) -> bool:
        """Whether PodMonitors can exist. A target that wants one looks again soon when they cannot (its CRD
        may be installed any time): discovery is asked at most every MONITOR_RECHECK_SECONDS for it."""
        if spec.external:
            return False
        wanted = spec.monitoring.pod_monitor.enabled
        max_age = MONITOR_RECHECK_SECONDS if wanted else DISCOVERY_TTL_SECONDS
        served = await self._api.serves(POD_MONITOR_API_VERSION, max_age=max_age)
        if wanted and not served:
            outcome.again_within(MONITOR_RECHECK_SECONDS)
        return served

    def _observe(
        self,
        key: TargetKey,
        snapshot: TargetSnapshot,
        spec: Eagle3TargetSpec,
        memory: _Memory,
        applied: Mapping[str, Mapping[str, Any]],
        refused: Failure | None,
        idle: IdleJudgement,
    ) -> Observation:
        namespace, name = key
        if spec.external:
            url = service_url(name, namespace, spec)
            # A URL the resource's author chose: status tells only whether a target server answers there.
            probes = self._prober.watch(key, {} if spec.suspend else {url: url}, disclose=False)
            self._prober.follow_download(key, None)
            return Observation(
                generation=snapshot.generation, spec=spec, url=url, probes=probes, consumers=idle.consumers
            )
        deployments = [c.deployment for c in self._children.owned(key) if c.deployment is not None]
        deployment = deployment_view(applied["Deployment"]) if "Deployment" in applied else only(deployments)
        pods = [pod for pod in self._pods_of(key) if not pod.hydration]
        # Pods not ready yet are probed too: a loading server's 503 says how far it has come.
        running = {p.name: endpoint_address(p.ip, spec.port) for p in pods if p.ip and not p.terminating}
        return Observation(
            generation=snapshot.generation,
            spec=spec,
            url=service_url(name, namespace, spec),
            selector=label_selector(name),
            deployment=deployment,
            pods=pods,
            probes=self._prober.watch(key, running),
            identity=model_identity(server_args(spec)),
            apply_failure=refused,
            hydration=self._hydration(key, spec, memory.pin),
            awaiting_download=self._prober.awaiting_download(key),
            idle=idle.idle,
            consumers=idle.consumers,
        )

    def _hydration(self, key: TargetKey, spec: Eagle3TargetSpec, pin: ImagePin) -> Hydration | None:
        """The download's state, from the hydration Job and its pods; its progress as the prober last read
        it from the running pod (the prober polls it while the download runs and asks for a pass when it
        moves)."""
        job_name = hydration_job_name(key[1], spec, pin)
        job = self._hydration_job(key, job_name)
        pods = [pod for pod in self._pods_of(key) if pod.hydration and not pod.terminating]
        # The newest attempt's pod (a Job's retry can overlap the failed one), so the URL does not flap.
        newest = sorted(pods, key=lambda p: (p.created or EPOCH, p.name), reverse=True)
        running = [p.ip for p in newest if p.ip and not p.finished]
        downloading = job_name is not None and bool(running) and not (job is not None and job.complete)
        url = endpoint_address(running[0], HYDRATION_PROGRESS_PORT) if downloading else None
        progress = describe_progress(self._prober.follow_download(key, url))
        if job_name is None:
            return None
        source = spec.hugging_face
        described = f"{source.repo}@{hf_revision(spec)} into claim {source.cache_claim_name}"
        return hydration_state(described, job, pods, progress)

    def _hydration_job(self, key: TargetKey, name: str | None) -> JobView | None:
        """The hydration Job of this name as the indexes show it (None: not created yet, or no download)."""
        return next(
            (c.job for c in self._children.owned(key) if c.job is not None and c.job.name == name), None
        )

    def _next_startup_deadline(self, observation: Observation) -> float | None:
        """StartupTimeout is the one verdict time alone changes: seconds until the next one falls (and a
        second more, so the pass that runs then sees it fallen)."""
        spec = observation.spec
        if spec is None or spec.external:
            return None
        budget = timedelta(seconds=spec.startup_timeout_seconds)
        now = self._clock()
        deadlines = [
            pod.started + budget
            for pod in observation.pods
            if pod.started is not None and not pod.ready and pod.started + budget > now
        ]
        return (min(deadlines) - now).total_seconds() + 1 if deadlines else None

    async def _announce(
        self, target: TargetRef, previous: Mapping[str, Any], status: Mapping[str, Any]
    ) -> None:
        for event in transitions(previous, status):
            await self._post_event(target, event)

    async def _post_event(self, target: TargetRef, event: Transition) -> None:
        try:
            await self._api.post_event(target, event.type, event.reason, event.message)
        except KubeError as error:  # An event is a courtesy: never fail the pass over it.
            logger.info(
                "could not post event %s on %s/%s: %s", event.reason, target.namespace, target.name, error
            )

    async def _warn_unknown_fields(self, key: TargetKey, snapshot: TargetSnapshot, memory: _Memory) -> None:
        """Once per set of fields (per process): fields of a newer CRD are ignored, and said so."""
        unknown = tuple(unknown_fields(snapshot.spec))
        if not unknown or unknown == memory.unknown:
            return
        memory.unknown = unknown
        message = (
            f"ignoring {', '.join(unknown)}: this operator does not know these fields (the installed CRD is"
            " newer than the operator; upgrade the operator to use them)"
        )
        logger.warning("%s/%s: %s", *key, message)
        await self._post_event(TargetRef(*key, snapshot.uid), Transition("Warning", "UnknownFields", message))

    def _pods_of(self, key: TargetKey) -> list[PodView]:
        """Pods are indexed by their instance label, which is the target's name fitted to a label value."""
        namespace, name = key
        return list(self._pods.get((namespace, selector_labels(name)[LABEL_INSTANCE])) or ())

    def _forget(self, key: TargetKey) -> None:
        self._memory.pop(key, None)
        self._queue.forget(key)
        self._prober.forget(key)
        self._instances.pop((key[0], selector_labels(key[1])[LABEL_INSTANCE]), None)
        self._published.pop(key, None)
        metrics.publish_targets(self._published.values())
        self._series.remove(key)
