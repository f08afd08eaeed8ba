"""Status from observation: what the cluster and the target servers show → the `Eagle3Target` status.

Everything here is pure (the clock is an argument), so the rules that users and training jobs depend on
(when Ready is True, which reason explains a stall, when a transition time moves) are tested without a
cluster. The operator writes the result only when it differs from the status already stored.

Ready is strict: every desired replica is a ready endpoint of the current Deployment revision, each
answering /readyz and /v1/info with one fingerprint. Available is what a training job needs to start: at
least one endpoint serves the current generation's model (its pod runs the model-deciding server flags
the current spec renders, and all such endpoints agree on one fingerprint), so it stays True through a
scale-up, a rollout that keeps the model, or replicas that cannot be scheduled. Only such endpoints are
published ready, so a job never lands on a pod serving another model. Degraded says "something needs a
human" and Progressing says "wait, it is moving"; both carry the reason a user acts on.
"""

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from eagle3_target.protocol import SERVER_FAILURE_EXIT_CODES, HydrationProgress, ServedModel

from eagle3_operator.constants import (
    DOWNLOAD_CONTAINER,
    HYDRATION_COMPONENT,
    LABEL_COMPONENT,
    SERVER_CONTAINER,
    WAIT_CONTAINER,
)
from eagle3_operator.render import model_identity
from eagle3_operator.spec import Eagle3TargetSpec

# The status keys this module owns; anything else under .status is left alone.
STATUS_KEYS = (
    "observedGeneration",
    "phase",
    "conditions",
    "url",
    "endpoints",
    "replicas",
    "readyReplicas",
    "updatedReplicas",
    "readyDesired",
    "selector",
    "model",
    "lastFailure",
)
CONDITION_TYPES = ("Ready", "Available", "Progressing", "Degraded")
# What status says about the target, as opposed to what it observed (url, endpoints, counts, model).
_JUDGEMENT_KEYS = ("observedGeneration", "phase", "conditions", "lastFailure")
EPOCH = datetime.fromtimestamp(0, UTC)
# The Degraded condition of every state that is not a failure.
NOT_DEGRADED = ("False", "AsExpected", "nothing is failing")

# Container waiting reasons that will not clear on their own, mapped to the reason the status reports.
WAITING_FAILURES = {
    "ErrImagePull": "ImagePullBackOff",
    "ImagePullBackOff": "ImagePullBackOff",
    "InvalidImageName": "ImagePullBackOff",
    "CrashLoopBackOff": "CrashLoopBackOff",
    "CreateContainerConfigError": "CreateContainerConfigError",
    "CreateContainerError": "CreateContainerError",
}
# Containers whose non-zero exit explains why a pod does not serve, with the reason the status reports.
# The server exits with EXIT_INVALID_SETTINGS or EXIT_LOAD_FAILED (and one line saying why) when it cannot
# load the model; the download's message is the tail of its log (terminationMessagePolicy in render.py).
EXIT_FAILURES = {DOWNLOAD_CONTAINER: "ModelDownloadFailed", SERVER_CONTAINER: "ModelLoadFailed"}
# Server pods in these phases are finished (evicted, refused by the kubelet's admission, shut down with
# their node, or exited): the ReplicaSet has replaced them, so they are neither endpoints nor replicas.
FINISHED_POD_PHASES = frozenset({"Failed", "Succeeded"})
# When several things fail differently, the reason reported is the first in this order (most actionable).
# The first ones are the API server's answers to applying a child (kube.KubeError.failure).
FAILURE_PRIORITY = (
    "NameConflict",
    "AdmissionDenied",
    "QuotaExceeded",
    "Forbidden",
    "Conflict",
    "ApplyFailed",
    "InvalidSpec",
    "Unschedulable",
    "ImagePullBackOff",
    "CreateContainerConfigError",
    "CreateContainerError",
    "ModelDownloadFailed",
    "ModelLoadFailed",
    "OOMKilled",
    "CrashLoopBackOff",
    "ReplicaFailure",
    "StartupTimeout",
    "ProgressDeadlineExceeded",
    "EndpointUnreachable",
    "FingerprintMismatch",
)


@dataclass(frozen=True)
class Failure:
    reason: str
    message: str


@dataclass(frozen=True)
class PodView:
    """The parts of a target pod that status needs; small, because one is kept in memory per pod."""

    name: str
    ip: str | None
    node: str | None
    ready: bool  # the pod's own Ready condition (kubelet probes)
    terminating: bool
    created: datetime | None
    started: datetime | None  # when the server container last started running (the startup budget's start)
    failure: Failure | None  # a failure readable from the pod alone (not time-based)
    progress: str | None = None  # what a pod that does not serve yet is doing, as far as the pod says
    identity: tuple[str, ...] = ()  # render.model_identity of the pod's server command
    hydration: bool = False  # a pod of the hydration Job, not a server pod
    finished: bool = False  # phase Succeeded or Failed: it will never run again


@dataclass(frozen=True)
class JobView:
    """The hydration Job's outcome so far."""

    name: str
    complete: bool
    failure: Failure | None  # the Job gave up (backoff limit, or a download that cannot succeed)


@dataclass(frozen=True)
class Hydration:
    """A huggingFace source's download into its cache claim, as status reports it."""

    source: str  # repo@revision into claim, for messages
    complete: bool
    failure: Failure | None = None
    progress: str | None = None  # files and bytes done, when the running download says


@dataclass(frozen=True)
class DeploymentView:
    generation: int
    observed_generation: int
    desired: int  # .spec.replicas
    replicas: int
    ready_replicas: int
    updated_replicas: int
    failure: Failure | None  # ReplicaFailure or ProgressDeadlineExceeded from its conditions


@dataclass(frozen=True)
class ProbeResult:
    """One server's answer: ready means /readyz said 200 and /v1/info parsed; else `error` says why."""

    ready: bool
    info: ServedModel | None = None  # what /v1/info reported, as status.model publishes it
    error: str | None = None
    reachable: bool = True
    progress: str | None = None  # a loading server's own account of its load (the message of its 503)


@dataclass(frozen=True)
class Observation:
    """Everything known about one target at one moment."""

    generation: int
    spec: Eagle3TargetSpec | None
    spec_error: str | None = None
    url: str | None = None
    selector: str | None = None
    deployment: DeploymentView | None = None
    pods: Sequence[PodView] = ()
    probes: Mapping[str, ProbeResult] = field(default_factory=dict)  # by pod name, or the URL when external
    hydration: Hydration | None = None  # only for huggingFace sources
    identity: tuple[str, ...] = ()  # render.model_identity of the server command the current spec renders
    apply_failure: Failure | None = None  # the API server refused to apply a child (or one is not ours)


@dataclass(frozen=True)
class Transition:
    """A change worth a Kubernetes event."""

    type: str  # Normal | Warning
    reason: str
    message: str


def timestamp(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_timestamp(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def endpoint_address(ip: str, port: int) -> str:
    """The base URL of a server at a pod IP (IPv6 addresses in brackets, as URLs need them)."""
    host = f"[{ip}]" if ipaddress.ip_address(ip).version == 6 else ip
    return f"http://{host}:{port}"


def pod_view(pod: Mapping[str, Any]) -> PodView | None:
    """Condense a Pod (as the API returns it) into what status needs; None for a finished server pod (a
    finished hydration pod still says why the download failed)."""
    metadata, spec, status = (pod.get(key) or {} for key in ("metadata", "spec", "status"))
    hydration = (metadata.get("labels") or {}).get(LABEL_COMPONENT) == HYDRATION_COMPONENT
    finished = status.get("phase") in FINISHED_POD_PHASES
    if finished and not hydration:
        return None
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    ready = (conditions.get("Ready") or {}).get("status") == "True"
    server: Mapping[str, Any] = next(
        (c for c in spec.get("containers") or [] if c.get("name") == SERVER_CONTAINER), {}
    )
    state: Mapping[str, Any] = next(
        (c for c in status.get("containerStatuses") or [] if c.get("name") == SERVER_CONTAINER), {}
    )
    running = (state.get("state") or {}).get("running") or {}
    return PodView(
        name=metadata.get("name", ""),
        ip=status.get("podIP") or None,
        node=spec.get("nodeName") or None,
        ready=ready,
        terminating=metadata.get("deletionTimestamp") is not None,
        created=parse_timestamp(metadata.get("creationTimestamp")),
        started=parse_timestamp(running.get("startedAt")),
        failure=_pod_failure(conditions.get("PodScheduled") or {}, status),
        progress=_pod_progress(status),
        hydration=hydration,
        finished=finished,
        identity=model_identity(server.get("command") or ()),
    )


def _pod_progress(status: Mapping[str, Any]) -> str | None:
    for container in status.get("initContainerStatuses") or []:
        if container.get("name") == WAIT_CONTAINER and "running" in (container.get("state") or {}):
            return f"waiting for the model download to complete ({WAIT_CONTAINER} running)"
    return None


def job_view(job: Mapping[str, Any]) -> JobView:
    conditions = {c.get("type"): c for c in (job.get("status") or {}).get("conditions") or []}
    complete = (conditions.get("Complete") or {}).get("status") == "True"
    failed = conditions.get("Failed") or {}
    failure = None
    if failed.get("status") == "True":
        reason = failed.get("reason") or "Failed"
        failure = Failure(
            "ModelDownloadFailed", f"{reason}: {failed.get('message') or 'the download Job failed'}"
        )
    return JobView(name=(job.get("metadata") or {}).get("name", ""), complete=complete, failure=failure)


def describe_progress(progress: HydrationProgress | None) -> str | None:
    """`3/17 files, 4.2 of 16.1 GB`, or what part of it is known."""
    if progress is None:
        return None
    parts = []
    if progress.files_total is not None:
        parts.append(f"{progress.files_done or 0}/{progress.files_total} files")
    if progress.bytes_total is not None:
        parts.append(f"{(progress.bytes_done or 0) / 1e9:.1f} of {progress.bytes_total / 1e9:.1f} GB")
    return ", ".join(parts) or None


def hydration_state(
    source: str, job: JobView | None, pods: Iterable[PodView], progress: str | None
) -> Hydration:
    """What the hydration Job and its pods say: complete, failed (with the failed attempt's own reason
    when a pod gave one), stuck on something a human must fix (an image, a Secret, a claim), or running."""
    pods = sorted(pods, key=lambda p: (p.created or EPOCH, p.name), reverse=True)
    if job is not None and job.complete:
        return Hydration(source, complete=True)
    if job is not None and job.failure is not None:
        said = next((p.failure for p in pods if p.finished and p.failure is not None), None)
        failure = Failure("ModelDownloadFailed", said.message) if said is not None else job.failure
        return Hydration(source, complete=False, failure=failure)
    stuck = next(((p, p.failure) for p in pods if not p.finished and p.failure is not None), None)
    if stuck is not None:
        pod, why = stuck
        failure = Failure(why.reason, f"hydration pod {pod.name}: {why.message}")
        return Hydration(source, complete=False, failure=failure)
    return Hydration(source, complete=False, progress=progress)


def _pod_failure(scheduled: Mapping[str, Any], status: Mapping[str, Any]) -> Failure | None:
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        return Failure("Unschedulable", scheduled.get("message") or "no node fits the pod")
    containers = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    for container in containers:
        failure = _exit_failure(container)
        if failure is not None:
            return failure
        waiting = (container.get("state") or {}).get("waiting") or {}
        reason = WAITING_FAILURES.get(waiting.get("reason", ""))
        if reason:
            message = waiting.get("message") or waiting["reason"]
            return Failure(reason, f"container {container.get('name')}: {message}")
    return None


def _exit_failure(container: Mapping[str, Any]) -> Failure | None:
    """Why a container that is not ready last stopped, when its exit says: an OOM kill, or a server (or
    download) that gave up and said why. Read from the current state or, once the kubelet restarted it,
    the last one, so the reason shows from the first exit on and stays while it crash-loops."""
    if container.get("ready"):
        return None
    name = container.get("name", "")
    state, last = container.get("state") or {}, container.get("lastState") or {}
    terminated = state.get("terminated") or last.get("terminated") or {}
    code = terminated.get("exitCode", 0)
    if not code:
        return None
    restarts = container.get("restartCount", 0)
    said = " ".join((terminated.get("message") or "").split())  # a log tail spans lines
    exited = f"container {name} exited with code {code}, {restarts} restarts"
    if terminated.get("reason") == "OOMKilled":
        return Failure(
            "OOMKilled", f"{exited}: killed at its memory limit; raise spec.resources.limits.memory"
        )
    reason = EXIT_FAILURES.get(name)
    if reason is None or (name == SERVER_CONTAINER and code not in SERVER_FAILURE_EXIT_CODES):
        return None
    return Failure(reason, f"{said} ({exited})" if said else exited)


def deployment_view(deployment: Mapping[str, Any]) -> DeploymentView:
    metadata, spec, status = (deployment.get(k) or {} for k in ("metadata", "spec", "status"))
    failure = None
    for condition in status.get("conditions") or []:
        if condition.get("type") == "ReplicaFailure" and condition.get("status") == "True":
            failure = Failure("ReplicaFailure", condition.get("message") or "pods cannot be created")
        elif condition.get("reason") == "ProgressDeadlineExceeded" and failure is None:
            failure = Failure("ProgressDeadlineExceeded", condition.get("message") or "rollout timed out")
    return DeploymentView(
        generation=metadata.get("generation", 0),
        observed_generation=status.get("observedGeneration", 0),
        desired=spec.get("replicas", 1),
        replicas=status.get("replicas", 0),
        ready_replicas=status.get("readyReplicas", 0),
        updated_replicas=status.get("updatedReplicas", 0),
        failure=failure,
    )


def compute_status(observation: Observation, previous: Mapping[str, Any], now: datetime) -> dict[str, Any]:
    """The full status (STATUS_KEYS only; None means "absent") for one observation."""
    if observation.spec is None:
        state = _invalid_state(observation, previous)
    elif observation.spec.external:
        state = _external_state(observation, observation.spec)
    else:
        state = _managed_state(observation, observation.spec, now)
    judged = state.conditions | {"Available": state.available or state.conditions["Ready"]}
    conditions = [
        _condition(kind, *judged[kind], observation.generation, previous, now) for kind in CONDITION_TYPES
    ]
    status = {key: None for key in STATUS_KEYS} | state.fields
    status["observedGeneration"] = observation.generation
    status["phase"] = state.phase
    status["conditions"] = conditions
    status["lastFailure"] = _last_failure(state.failure, previous.get("lastFailure"), now)
    return {key: _compact(value) for key, value in status.items()}


def status_patch(previous: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """A merge patch from the stored status to `new`; empty when nothing changed (then nothing is written)."""
    return {key: new.get(key) for key in STATUS_KEYS if previous.get(key) != new.get(key)}


def transitions(previous: Mapping[str, Any], new: Mapping[str, Any]) -> list[Transition]:
    """Events for conditions whose status or reason changed: Warning for failures, Normal otherwise.

    Available is announced only when it says something Ready's own event does not: not when Ready moved to
    the same status in the same transition.
    """
    before = {c["type"]: c for c in previous.get("conditions") or [] if "type" in c}
    after = {c["type"]: c for c in new.get("conditions") or []}
    ready_moved_to = (after.get("Ready") or {}).get("status")
    if (before.get("Ready") or {}).get("status") == ready_moved_to:
        ready_moved_to = None
    events: list[Transition] = []
    for condition in new.get("conditions") or []:
        if any(event.reason == condition["reason"] for event in events):
            continue
        old = before.get(condition["type"], {})
        if (old.get("status"), old.get("reason")) == (condition["status"], condition["reason"]):
            continue
        if condition["type"] == "Available" and condition["status"] == ready_moved_to:
            continue
        if not old and condition["type"] != "Ready" and condition["status"] == "False":
            continue  # A new target that is not progressing or degraded: nothing worth an event.
        failing = condition["type"] == "Degraded" and condition["status"] == "True"
        failing |= condition["type"] in ("Ready", "Available") and condition["reason"] in FAILURE_PRIORITY
        message = f"{condition['type']}={condition['status']}: {condition['message']}"
        events.append(Transition("Warning" if failing else "Normal", condition["reason"], message))
    return events


def _compact(value: Any) -> Any:
    """Drop None members: the API server stores no nulls, so a stored status never contains them."""
    if isinstance(value, Mapping):
        return {k: _compact(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_compact(v) for v in value]
    return value


@dataclass(frozen=True)
class _State:
    phase: str
    conditions: dict[str, tuple[str, str, str]]  # Ready, Progressing, Degraded -> (status, reason, message)
    fields: dict[str, Any]
    failure: Failure | None
    available: tuple[str, str, str] | None = None  # Available when it is not simply what Ready says


def _invalid_state(observation: Observation, previous: Mapping[str, Any]) -> _State:
    """Children are left as they were, so what they serve (url, endpoints, model) stays published."""
    message = observation.spec_error or "the spec is invalid"
    kept = {key: previous.get(key) for key in STATUS_KEYS if key not in _JUDGEMENT_KEYS}
    return _State(
        phase="Failed",
        conditions={
            "Ready": ("False", "InvalidSpec", message),
            "Progressing": ("False", "InvalidSpec", message),
            "Degraded": ("True", "InvalidSpec", message),
        },
        fields=kept,
        failure=Failure("InvalidSpec", message),
    )


def _external_state(observation: Observation, spec: Eagle3TargetSpec) -> _State:
    url = spec.endpoint.url if spec.endpoint else None
    probe = observation.probes.get(url or "")
    ready = probe is not None and probe.ready and not spec.suspend
    fields = {
        "url": url,
        "endpoints": [{"address": url, "ready": ready}],
        "replicas": 1,
        "readyReplicas": int(ready),
        "updatedReplicas": 1,
        "readyDesired": f"{int(ready)}/1",
        "model": probe.info.to_status() if ready and probe is not None and probe.info else None,
    }
    if spec.suspend:
        return _State(
            "Suspended", _quiet("False", "Suspended", "suspended: the endpoint is not probed"), fields, None
        )
    if ready:
        return _State("Ready", _quiet("True", "EndpointReady", f"{url} is ready"), fields, None)
    error = _probe_error(probe)
    if probe is not None and probe.reachable:
        conditions = {
            "Ready": ("False", "EndpointNotReady", f"{url}: {error}"),
            "Progressing": ("True", "Loading", f"{url} answers but is not ready: {error}"),
            "Degraded": NOT_DEGRADED,
        }
        return _State("Loading", conditions, fields, None)
    failure = Failure("EndpointUnreachable", f"{url}: {error}")
    return _State("Failed", _failed(failure), fields, failure)


def _managed_state(observation: Observation, spec: Eagle3TargetSpec, now: datetime) -> _State:
    desired = spec.effective_replicas
    deployment = observation.deployment
    pods = sorted((p for p in observation.pods if not p.terminating), key=lambda p: p.name)
    serving = [pod for pod in pods if _serving(pod, observation)]
    endpoints = [
        {
            "pod": pod.name,
            "address": endpoint_address(pod.ip, spec.port),
            "ready": pod in serving,
            "node": pod.node,
        }
        for pod in pods
        if pod.ip
    ]
    newest_first = sorted(serving, key=lambda p: p.created or EPOCH, reverse=True)
    infos = [info for pod in newest_first if (info := observation.probes[pod.name].info) is not None]
    fields = {
        "url": observation.url,
        "endpoints": endpoints,
        "replicas": deployment.replicas if deployment else 0,
        "readyReplicas": len(serving),
        "updatedReplicas": deployment.updated_replicas if deployment else 0,
        "readyDesired": f"{len(serving)}/{desired}",
        "selector": observation.selector,
        "model": infos[0].to_status() if infos else None,
    }
    rolled_out = (
        deployment is not None
        and deployment.desired == desired
        and deployment.observed_generation >= deployment.generation
        and deployment.updated_replicas == desired
        and deployment.replicas == desired
        and len(observation.pods) == desired
    )
    if spec.suspend:
        return _suspended_state(observation, fields)
    progress = f"{len(serving)}/{desired} replicas serving"
    fingerprints = sorted({info.fingerprint for info in infos})
    offered = len(fingerprints) == 1 and desired > 0  # scaled to zero, the pods left are only stopping
    available = ("True", "Serving", f"{progress} {fingerprints[0]}") if offered else None
    hydration = observation.hydration
    if hydration is not None and not hydration.complete and observation.apply_failure is None:
        return _hydrating_state(hydration, fields, serving=bool(serving))
    failure = _first_failure(pods, deployment, observation, spec, now)
    if len(fingerprints) > 1:  # endpoints running the same model-deciding flags answer different models
        mismatch = Failure("FingerprintMismatch", f"replicas serve different models: {fingerprints}")
        failure = min(failure or mismatch, mismatch, key=lambda f: FAILURE_PRIORITY.index(f.reason))
    if failure is not None:
        phase = "Degraded" if serving else "Failed"
        return _State(phase, _failed(failure), fields, failure, available)
    if desired == 0:
        return _State("Pending", _quiet("False", "ScaledToZero", "spec.replicas is 0"), fields, None)
    if rolled_out and len(serving) == desired:
        return _State("Ready", _quiet("True", "AllReplicasReady", progress), fields, None, available)
    loading = {pod.name: text for pod in pods if (text := _loading(pod, observation))}
    unprobed = [p.name for p in pods if p.ready and not _serving(p, observation) and p.name not in loading]
    reason, detail = ("Loading", "loading") if rolled_out else ("RollingOut", "rolling out the current spec")
    if unprobed:
        errors = "; ".join(f"{name}: {_probe_error(observation.probes.get(name))}" for name in unprobed)
        detail = f"pods ready but their servers are not: {errors}"
    if loading:
        detail = f"{detail}; {'; '.join(f'{name}: {text}' for name, text in loading.items())}"
    conditions = {
        "Ready": ("False", reason, f"{progress}; {detail}"),
        "Progressing": ("True", reason, f"{progress}; {detail}"),
        "Degraded": NOT_DEGRADED,
    }
    phase = "Loading" if any(p.node for p in pods) else "Pending"
    return _State(phase, conditions, fields, None, available)


def _hydrating_state(hydration: Hydration, fields: dict[str, Any], *, serving: bool) -> _State:
    """No server pod is asked for until the cache is complete (pods of a previous revision keep serving)."""
    if hydration.failure is not None:
        return _State(
            "Degraded" if serving else "Failed", _failed(hydration.failure), fields, hydration.failure
        )
    message = f"downloading {hydration.source}"
    if hydration.progress:
        message = f"{message}: {hydration.progress}"
    conditions = {
        "Ready": ("False", "Downloading", message),
        "Progressing": ("True", "Downloading", message),
        "Degraded": NOT_DEGRADED,
    }
    return _State("Pending", conditions, fields, None)


def _suspended_state(observation: Observation, fields: dict[str, Any]) -> _State:
    remaining = len(observation.pods)
    progressing = (
        ("True", "Suspending", f"{remaining} pods still stopping")
        if remaining
        else ("False", "Suspended", "no pods run while suspended")
    )
    conditions = {
        "Ready": ("False", "Suspended", "spec.suspend is true"),
        "Progressing": progressing,
        "Degraded": NOT_DEGRADED,
    }
    return _State("Suspended", conditions, fields, None)


def _serving(pod: PodView, observation: Observation) -> bool:
    """The pod serves the current generation's model: ready, probed ready, and running the model-deciding
    server flags the current spec renders (an old pod of a rollout that keeps the model qualifies)."""
    probe = observation.probes.get(pod.name)
    current = pod.identity == observation.identity
    return (
        current
        and pod.ready
        and not pod.terminating
        and probe is not None
        and probe.ready
        and probe.info is not None
    )


def _loading(pod: PodView, observation: Observation) -> str | None:
    """How far a pod that does not serve yet has come: its download, else its server's own load progress."""
    if pod.terminating or _serving(pod, observation):
        return None
    probe = observation.probes.get(pod.name)
    return pod.progress or (probe.progress if probe is not None else None)


def _probe_error(probe: ProbeResult | None) -> str:
    return probe.error if probe is not None and probe.error else "not probed yet"


def _first_failure(
    pods: Iterable[PodView],
    deployment: DeploymentView | None,
    observation: Observation,
    spec: Eagle3TargetSpec,
    now: datetime,
) -> Failure | None:
    found: list[Failure] = []
    budget = spec.startup_timeout_seconds
    if observation.apply_failure is not None:
        found.append(observation.apply_failure)
    for pod in pods:
        if pod.failure is not None:
            found.append(Failure(pod.failure.reason, f"pod {pod.name}: {pod.failure.message}"))
        elif pod.ready and not (probe := observation.probes.get(pod.name, ProbeResult(False))).reachable:
            # The kubelet's probe passes, ours cannot connect: something between operator and pod is wrong.
            found.append(Failure("EndpointUnreachable", f"pod {pod.name}: {probe.error}"))
        elif not pod.ready and pod.started and (now - pod.started).total_seconds() > budget:
            # No elapsed time in the message: it would change, and so rewrite the status, on every probe.
            message = (
                f"pod {pod.name} not ready within startupTimeoutSeconds={budget} of {timestamp(pod.started)}"
            )
            found.append(Failure("StartupTimeout", message))
    if deployment is not None and deployment.failure is not None:
        found.append(deployment.failure)
    return min(found, key=lambda f: FAILURE_PRIORITY.index(f.reason), default=None)


def _failed(failure: Failure) -> dict[str, tuple[str, str, str]]:
    return {
        "Ready": ("False", failure.reason, failure.message),
        "Progressing": ("False", failure.reason, failure.message),
        "Degraded": ("True", failure.reason, failure.message),
    }


def _quiet(ready: str, reason: str, message: str) -> dict[str, tuple[str, str, str]]:
    """Conditions for a settled state: nothing progressing, nothing degraded."""
    return {
        "Ready": (ready, reason, message),
        "Progressing": ("False", reason, message),
        "Degraded": NOT_DEGRADED,
    }


def _condition(
    kind: str,
    status: str,
    reason: str,
    message: str,
    generation: int,
    previous: Mapping[str, Any],
    now: datetime,
) -> dict[str, Any]:
    old: Mapping[str, Any] = next((c for c in previous.get("conditions") or [] if c.get("type") == kind), {})
    moved = old.get("status") != status or not old.get("lastTransitionTime")
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": timestamp(now) if moved else old["lastTransitionTime"],
        "observedGeneration": generation,
    }


def _last_failure(failure: Failure | None, previous: Mapping[str, Any] | None, now: datetime) -> Any:
    """The most recent failure, kept after recovery; its time moves only when the reason changes."""
    if failure is None:
        return previous
    if previous and previous.get("reason") == failure.reason and previous.get("time"):
        return {"reason": failure.reason, "message": failure.message, "time": previous["time"]}
    return {"reason": failure.reason, "message": failure.message, "time": timestamp(now)}
