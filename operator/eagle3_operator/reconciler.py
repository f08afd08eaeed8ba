"""One level-based reconcile per target: children in place, servers probed, status written only on change.

Every trigger (the target changed, a child or pod changed, the periodic re-probe) just asks for a pass over
one target; requests that arrive while a pass runs fold into a single follow-up pass. A pass reads only
in-memory state (kopf's indexes of the target, its children and its pods), so it makes API calls only to
change something: a child that differs from what is rendered (or is missing, or should not exist) is
applied or deleted, and the status is patched with just the keys that changed.
"""

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from kubernetes.utils import parse_quantity

from eagle3_operator import metrics
from eagle3_operator.constants import (
    CHILD_KINDS,
    HYDRATION_PROGRESS_PORT,
    LABEL_INSTANCE,
    POD_MONITOR_API_VERSION,
)
from eagle3_operator.kube import KubeApi, KubeError, TargetRef
from eagle3_operator.probe import Prober
from eagle3_operator.render import (
    Neighbours,
    build_children,
    hf_revision,
    hydration_job_name,
    label_selector,
    selector_labels,
    service_url,
)
from eagle3_operator.spec import Eagle3TargetSpec, InvalidSpec
from eagle3_operator.status import (
    DeploymentView,
    Hydration,
    JobView,
    Observation,
    PodView,
    ProbeResult,
    compute_status,
    deployment_view,
    describe_progress,
    hydration_state,
    status_patch,
    transitions,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

TargetKey = tuple[str, str]  # (namespace, name)
SECRET_TTL_SECONDS = 60.0
MAX_CONCURRENT_RECONCILES = 32
RETRY_DELAYS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
# Children whose kind has no index (its CRD may not even exist): applied when the rendering changes only, and
# deleted when no longer rendered if this operator process applied them.
UNWATCHED_KINDS = frozenset(child.kind for child in CHILD_KINDS if not child.watched)
REJECTED = (400, 422)  # the API server will not take the child as rendered: no retry can help


@dataclass(frozen=True)
class TargetSnapshot:
    """What the target index keeps per Eagle3Target."""

    uid: str
    generation: int
    resource_version: str
    spec: Mapping[str, Any]
    status: Mapping[str, Any]
    deleting: bool


@dataclass(frozen=True)
class ChildState:
    """What a child index keeps per owned object: enough to detect drift, and the Deployment's progress."""

    api_version: str
    kind: str
    name: str
    uid: str
    resource_version: str
    owner_uid: str
    essence: Mapping[str, Any]  # metadata labels/annotations/ownerReferences and spec: what drift compares
    deployment: DeploymentView | None = None
    job: JobView | None = None


def essence(body: Mapping[str, Any]) -> dict[str, Any]:
    metadata = body.get("metadata") or {}
    kept = {k: metadata[k] for k in ("labels", "annotations", "ownerReferences") if k in metadata}
    return {"metadata": kept, "spec": body.get("spec") or {}}


def matches(desired: Any, observed: Any) -> bool:
    """Whether every field the operator renders has that value in the observed object.

    Fields the API server adds (defaults, status, clusterIP) are ignored; lists must match item by item;
    quantities compare by value (the server stores 1 GPU as "1" and 1024Mi as "1Gi").
    """
    if isinstance(desired, Mapping):
        return isinstance(observed, Mapping) and all(
            key in observed and matches(value, observed[key]) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(observed, list)
            and len(desired) == len(observed)
            and all(matches(d, o) for d, o in zip(desired, observed, strict=True))
        )
    if isinstance(desired, bool) or isinstance(observed, bool):  # True == 1 in Python, not in Kubernetes
        return type(desired) is type(observed) and desired == observed
    if desired == observed:
        return True
    if isinstance(desired, str | int) and isinstance(observed, str | int):
        try:
            return parse_quantity(desired) == parse_quantity(observed)
        except ValueError:
            return False
    return False


def _digest(manifest: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


@dataclass
class _Memory:
    """What the reconciler remembers about one target between passes (lost on restart, rebuilt by a pass)."""

    uid: str = ""
    written_status: dict[str, Any] | None = None
    written_version: str | None = None
    # Target resourceVersions that this operator's own status writes have superseded: while the index shows
    # one of them, it has not caught up with the last write, and the written status stands in for the stored.
    superseded: set[str] = field(default_factory=set)
    applied: dict[tuple[str, str], tuple[str, str]] = field(
        default_factory=dict
    )  # (kind, name) -> digest, rv
    # Children of UNWATCHED_KINDS this operator applied, (kind, name) -> (apiVersion, uid): no index shows
    # them, so this is how one that is no longer wanted is found and deleted.
    unwatched: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    failures: int = 0


class Reconciler:
    def __init__(
        self,
        api: KubeApi,
        prober: Prober,
        *,
        targets: Mapping[TargetKey, Iterable[TargetSnapshot]],
        children: Iterable[Mapping[TargetKey, Iterable[ChildState]]],
        pods: Mapping[TargetKey, Iterable[PodView]],
        neighbours: Neighbours | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        """`targets`, `children` and `pods` are kopf indexes (key → the values indexed under it)."""
        self._api = api
        self._neighbours = neighbours or Neighbours()
        self._prober = prober
        self._targets = targets
        self._children = list(children)
        self._pods = pods
        self._clock = clock
        self._memory: dict[TargetKey, _Memory] = {}
        self._pending: set[TargetKey] = set()
        self._workers: dict[TargetKey, asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_RECONCILES)
        self._secrets: dict[tuple[str, str, str], tuple[float, str]] = {}  # (ns, name, key) -> (when, token)
        self._instances: dict[TargetKey, str] = {}  # (namespace, pod instance label) -> target name
        self._published: dict[TargetKey, tuple[str, int]] = {}  # what the target gauges count: phase, ready

    def request(self, key: TargetKey) -> None:
        """Ask for a pass over one target; cheap, never blocks, coalesces with a pass already queued."""
        self._pending.add(key)
        if key not in self._workers:
            self._workers[key] = asyncio.create_task(self._work(key), name=f"reconcile {key[0]}/{key[1]}")

    def request_instance(self, namespace: str, instance: str) -> None:
        """Ask for a pass over the target whose pods carry this instance label (pods have no owner link)."""
        name = self._instances.get((namespace, instance))
        if name is not None:
            self.request((namespace, name))

    @property
    def known_targets(self) -> int:
        return len(self._memory)

    def is_own_write(self, key: TargetKey, resource_version: str) -> bool:
        """Whether a target event is only the echo of the status this reconciler just wrote."""
        memory = self._memory.get(key)
        return memory is not None and memory.written_version == resource_version

    async def reprobe_forever(self, interval: float) -> None:
        """Notice servers becoming (un)ready, which no Kubernetes event announces; writes only on change."""
        while True:
            await asyncio.sleep(interval)
            for key in list(self._memory):
                if self._pods_of(key) or self._is_external(key):
                    self.request(key)

    async def _work(self, key: TargetKey) -> None:
        try:
            while key in self._pending:
                self._pending.discard(key)
                async with self._slots:
                    await self._pass_with_retry(key)
        finally:
            del self._workers[key]

    async def _pass_with_retry(self, key: TargetKey) -> None:
        started = time.monotonic()
        try:
            result = await self.reconcile(key)
        except Exception as error:  # The worker's boundary: log, back off, try again; never lose the target.
            memory = self._memory.setdefault(key, _Memory())
            delay = RETRY_DELAYS[min(memory.failures, len(RETRY_DELAYS) - 1)]
            memory.failures += 1
            log = logger.warning if isinstance(error, KubeError | OSError) else logger.exception
            log("reconcile of %s/%s failed, retrying in %.0fs: %s", *key, delay, error)
            asyncio.get_running_loop().call_later(delay, self.request, key)
            result = "error"
        metrics.RECONCILES.labels(result=result).inc()
        metrics.RECONCILE_DURATION.observe(time.monotonic() - started)

    async def reconcile(self, key: TargetKey) -> str:
        """One pass; returns the result label for metrics (ok, invalid_spec, gone)."""
        snapshot = _only(self._targets.get(key))
        if snapshot is None or snapshot.deleting:
            self._forget(key)  # Deleted: owner references let the garbage collector remove the children.
            return "gone"
        memory = self._memory.get(key)
        if memory is None or memory.uid != snapshot.uid:  # new, or deleted and created again under the name
            memory = self._memory[key] = _Memory(uid=snapshot.uid)
        namespace, name = key
        self._instances[namespace, selector_labels(name)[LABEL_INSTANCE]] = name
        try:
            spec = Eagle3TargetSpec.parse(dict(snapshot.spec))
        except InvalidSpec as error:
            observation = Observation(generation=snapshot.generation, spec=None, spec_error=str(error))
        else:
            try:
                applied = await self._sync_children(key, snapshot, spec, memory)
            except KubeError as error:
                if error.status not in REJECTED:
                    raise
                # The spec renders to a child the API server refuses (e.g. an admission policy): retrying
                # cannot help until the spec changes, so report it the way an invalid spec is reported.
                message = f"the API server rejected a child: {error}"
                observation = Observation(generation=snapshot.generation, spec=None, spec_error=message)
            else:
                observation = await self._observe(key, snapshot, spec, applied)
        lagging = memory.written_status is not None and snapshot.resource_version in memory.superseded
        if not lagging:  # The index shows the last write, or a later write by someone else: trust it.
            memory.superseded.clear()
        previous = (
            memory.written_status if lagging and memory.written_status is not None else dict(snapshot.status)
        )
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
        memory.failures = 0
        self._published[key] = (status["phase"], status.get("readyReplicas") or 0)
        metrics.publish_targets(self._published.values())
        return "ok" if observation.spec is not None else "invalid_spec"

    async def _sync_children(
        self, key: TargetKey, snapshot: TargetSnapshot, spec: Eagle3TargetSpec, memory: _Memory
    ) -> dict[str, dict[str, Any]]:
        """Apply what differs from the rendering, delete what should not exist; return what was applied."""
        namespace, name = key
        monitor_wanted = spec.monitoring.pod_monitor.enabled and not spec.external
        monitors = monitor_wanted and await self._api.serves(POD_MONITOR_API_VERSION)
        observed = {
            (child.kind, child.name): child
            for child in self._owned_children(key)
            if child.owner_uid == snapshot.uid
        }
        job_name = hydration_job_name(name, spec)
        job = observed.get(("Job", job_name)) if job_name is not None else None
        hydrated = job_name is None or (job is not None and job.job is not None and job.job.complete)
        desired = build_children(
            name,
            namespace,
            snapshot.uid,
            spec,
            pod_monitor_supported=monitors,
            neighbours=self._neighbours,
            hydrated=hydrated,
        )
        applied: dict[str, dict[str, Any]] = {}
        for manifest in desired:
            child_key = (manifest["kind"], manifest["metadata"]["name"])
            current = observed.pop(child_key, None)
            if manifest["kind"] == "Deployment" and not hydrated and current is not None:
                continue  # Held as is (its pods may serve a previous revision) until the download completes.
            digest = _digest(manifest)
            if manifest["kind"] in UNWATCHED_KINDS and memory.applied.get(child_key, ("",))[0] == digest:
                continue
            if current is not None and (
                memory.applied.get(child_key) == (digest, current.resource_version)
                or matches(essence(manifest), current.essence)
            ):
                continue
            result = await self._api.apply(manifest)
            metrics.CHILD_APPLIES.labels(kind=manifest["kind"]).inc()
            result_metadata = result.get("metadata") or {}
            memory.applied[child_key] = (digest, result_metadata.get("resourceVersion", ""))
            if manifest["kind"] in UNWATCHED_KINDS:
                memory.unwatched[child_key] = (manifest["apiVersion"], result_metadata.get("uid", ""))
            applied[manifest["kind"]] = result
        rendered = {(m["kind"], m["metadata"]["name"]) for m in desired}
        unwanted = [
            ChildState(api_version, kind, name, uid, "", snapshot.uid, {})
            for (kind, name), (api_version, uid) in memory.unwatched.items()
            if (kind, name) not in rendered
        ]
        for child in [*observed.values(), *unwanted]:
            await self._api.delete(child.api_version, child.kind, namespace, child.name, child.uid)
            memory.applied.pop((child.kind, child.name), None)
            memory.unwatched.pop((child.kind, child.name), None)
        return applied

    async def _observe(
        self,
        key: TargetKey,
        snapshot: TargetSnapshot,
        spec: Eagle3TargetSpec,
        applied: Mapping[str, Mapping[str, Any]],
    ) -> Observation:
        namespace, name = key
        token = await self._token(namespace, spec)
        if spec.external:
            url = service_url(name, namespace, spec)
            external = {} if spec.suspend else await self._prober.probe_many({url: url}, token)
            _count(external)
            return Observation(generation=snapshot.generation, spec=spec, url=url, probes=external)
        deployments = [c.deployment for c in self._owned_children(key) if c.deployment is not None]
        deployment = deployment_view(applied["Deployment"]) if "Deployment" in applied else _only(deployments)
        pods = [pod for pod in self._pods_of(key) if not pod.hydration]
        # Pods not ready yet are probed too: a loading server's 503 says how far it has come.
        running = {p.name: f"http://{p.ip}:{spec.port}" for p in pods if p.ip and not p.terminating}
        probes: dict[str, ProbeResult] = await self._prober.probe_many(running, token) if running else {}
        _count(probes)
        return Observation(
            generation=snapshot.generation,
            spec=spec,
            url=service_url(name, namespace, spec),
            selector=label_selector(name),
            deployment=deployment,
            pods=pods,
            probes=probes,
            hydration=await self._hydration(key, spec),
        )

    async def _hydration(self, key: TargetKey, spec: Eagle3TargetSpec) -> Hydration | None:
        """The download's state, from the hydration Job and its pods; its progress from the running pod."""
        job_name = hydration_job_name(key[1], spec)
        if job_name is None:
            return None
        source = spec.hugging_face
        described = f"{source.repo}@{hf_revision(spec)} into claim {source.cache_claim_name}"
        job = next(
            (c.job for c in self._owned_children(key) if c.job is not None and c.job.name == job_name), None
        )
        pods = [pod for pod in self._pods_of(key) if pod.hydration and not pod.terminating]
        running = [p for p in pods if p.ip and not p.finished]
        progress = None
        if running and not (job is not None and job.complete):
            url = f"http://{running[0].ip}:{HYDRATION_PROGRESS_PORT}"
            progress = describe_progress(await self._prober.hydration_progress(url))
        return hydration_state(described, job, pods, progress)

    async def _token(self, namespace: str, spec: Eagle3TargetSpec) -> str | None:
        """The bearer token /v1/info needs when spec.auth is set; cached briefly (it is read per pass)."""
        if spec.auth is None:
            return None
        ref = spec.auth.token_secret_ref
        cache_key = (namespace, ref.name, ref.key)
        cached = self._secrets.get(cache_key)
        if cached is not None and time.monotonic() - cached[0] < SECRET_TTL_SECONDS:
            return cached[1]
        token = await self._api.read_secret_key(namespace, ref.name, ref.key)
        if token is not None:  # A missing Secret is looked up again next pass: it may be created any moment.
            self._secrets[cache_key] = (time.monotonic(), token)
        return token

    async def _announce(
        self, target: TargetRef, previous: Mapping[str, Any], status: Mapping[str, Any]
    ) -> None:
        for event in transitions(previous, status):
            try:
                await self._api.post_event(target, event.type, event.reason, event.message)
            except KubeError as error:  # An event is a courtesy: never fail the pass over it.
                logger.info(
                    "could not post event %s on %s/%s: %s", event.reason, target.namespace, target.name, error
                )

    def _pods_of(self, key: TargetKey) -> list[PodView]:
        """Pods are indexed by their instance label, which is the target's name fitted to a label value."""
        namespace, name = key
        return list(self._pods.get((namespace, selector_labels(name)[LABEL_INSTANCE])) or ())

    def _owned_children(self, key: TargetKey) -> list[ChildState]:
        return [child for index in self._children for child in index.get(key) or ()]

    def _is_external(self, key: TargetKey) -> bool:
        snapshot = _only(self._targets.get(key))
        return snapshot is not None and bool(snapshot.spec.get("endpoint"))

    def _forget(self, key: TargetKey) -> None:
        self._memory.pop(key, None)
        self._instances.pop((key[0], selector_labels(key[1])[LABEL_INSTANCE]), None)
        self._published.pop(key, None)
        metrics.publish_targets(self._published.values())


def _only(values: Iterable[T] | None) -> T | None:
    """The single value a kopf index holds under a key (None if nothing is indexed there)."""
    return next(iter(values), None) if values is not None else None


def _count(probes: Mapping[str, ProbeResult]) -> None:
    for result in probes.values():
        metrics.PROBES.labels(outcome="ready" if result.ready else "not_ready").inc()
