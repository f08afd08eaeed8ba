"""The rules: which phase, conditions and failure an observation of a target means.

One function per kind of target (an invalid spec, an external endpoint, managed pods, and the managed
target's download and suspension), each returning a `TargetState`: the judgement plus the fields status
reports from what it observed. The most actionable failure wins (observation.most_actionable).
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from eagle3_operator.spec import Eagle3TargetSpec
from eagle3_operator.status import reasons
from eagle3_operator.status.conditions import NOT_DEGRADED, Condition, failed, quiet
from eagle3_operator.status.idle import idle_message
from eagle3_operator.status.observation import (
    EPOCH,
    NOT_PROBED_YET,
    DeploymentView,
    Failure,
    Hydration,
    Observation,
    PodView,
    ProbeResult,
    endpoint_address,
    most_actionable,
    timestamp,
)

# The status fields a state reports from what it observed; the rest of the status is its judgement.
OBSERVED_KEYS = (
    "url",
    "endpoints",
    "replicas",
    "readyReplicas",
    "updatedReplicas",
    "readyDesired",
    "selector",
    "model",
    "idle",
    "consumers",
)


@dataclass(frozen=True)
class TargetState:
    """What an observation means: a phase, the Ready, Progressing and Degraded conditions, the failure that
    explains it (if any), and the fields observed (OBSERVED_KEYS)."""

    phase: str
    conditions: dict[str, Condition]  # Ready, Progressing, Degraded
    fields: dict[str, Any]
    failure: Failure | None
    available: Condition | None = None  # Available when it is not simply what Ready says


def target_state(observation: Observation, previous: Mapping[str, Any], now: datetime) -> TargetState:
    """The state one observation means; `previous` (the stored status) matters only to an invalid spec."""
    if observation.spec is None:
        return _invalid_state(observation, previous)
    if observation.spec.external:
        return _external_state(observation, observation.spec)
    return _managed_state(observation, observation.spec, now)


def _invalid_state(observation: Observation, previous: Mapping[str, Any]) -> TargetState:
    """Children are left as they were, so what they serve (url, endpoints, model) stays published."""
    message = observation.spec_error or "the spec is invalid"
    kept = {key: previous.get(key) for key in OBSERVED_KEYS}
    failure = Failure(reasons.INVALID_SPEC, message)
    return TargetState("Failed", failed(failure), kept, failure)


def _external_state(observation: Observation, spec: Eagle3TargetSpec) -> TargetState:
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
        "consumers": observation.consumers,
    }
    if spec.suspend:
        return TargetState(
            "Suspended",
            quiet("False", reasons.SUSPENDED, "suspended: the endpoint is not probed"),
            fields,
            None,
        )
    if ready:
        return TargetState("Ready", quiet("True", reasons.ENDPOINT_READY, f"{url} is ready"), fields, None)
    error = _probe_error(probe)
    if probe is not None and probe.reachable:
        conditions = {
            "Ready": Condition("False", reasons.ENDPOINT_NOT_READY, f"{url}: {error}"),
            "Progressing": Condition("True", reasons.LOADING, f"{url} answers but is not ready: {error}"),
            "Degraded": NOT_DEGRADED,
        }
        return TargetState("Loading", conditions, fields, None)
    failure = Failure(reasons.ENDPOINT_UNREACHABLE, f"{url}: {error}")
    return TargetState("Failed", failed(failure), fields, failure)


def _managed_state(observation: Observation, spec: Eagle3TargetSpec, now: datetime) -> TargetState:
    desired = 0 if observation.idle is not None else spec.effective_replicas
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
        "idle": observation.idle,
        "consumers": observation.consumers,
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
    if observation.idle is not None and observation.apply_failure is None:
        return _idle_state(spec, fields)  # a refused scale-down is a failure: its pods and GPUs stay
    progress = f"{len(serving)}/{desired} replicas serving"
    fingerprints = sorted({info.fingerprint for info in infos})
    offered = len(fingerprints) == 1 and desired > 0  # scaled to zero, the pods left are only stopping
    available = Condition("True", reasons.SERVING, f"{progress} {fingerprints[0]}") if offered else None
    hydration = observation.hydration
    if hydration is not None and not hydration.complete and observation.apply_failure is None:
        return _hydrating_state(hydration, fields, serving=bool(serving))
    failure = _first_failure(pods, deployment, observation, spec, now)
    if len(fingerprints) > 1:  # endpoints running the same model-deciding flags answer different models
        mismatch = Failure(reasons.FINGERPRINT_MISMATCH, f"replicas serve different models: {fingerprints}")
        failure = most_actionable([mismatch] if failure is None else [failure, mismatch])
    if failure is not None:
        phase = "Degraded" if serving else "Failed"
        return TargetState(phase, failed(failure), fields, failure, available)
    if desired == 0:
        return TargetState(
            "Pending", quiet("False", reasons.SCALED_TO_ZERO, "spec.replicas is 0"), fields, None
        )
    if rolled_out and len(serving) == desired:
        return TargetState(
            "Ready", quiet("True", reasons.ALL_REPLICAS_READY, progress), fields, None, available
        )
    loading = {pod.name: text for pod in pods if (text := _loading(pod, observation))}
    unprobed = [p.name for p in pods if p.ready and not _serving(p, observation) and p.name not in loading]
    reason, detail = (
        (reasons.LOADING, "loading") if rolled_out else (reasons.ROLLING_OUT, "rolling out the current spec")
    )
    if unprobed:
        errors = "; ".join(f"{name}: {_probe_error(observation.probes.get(name))}" for name in unprobed)
        detail = f"pods ready but their servers are not: {errors}"
    if loading:
        detail = f"{detail}; {'; '.join(f'{name}: {text}' for name, text in loading.items())}"
    conditions = {
        "Ready": Condition("False", reason, f"{progress}; {detail}"),
        "Progressing": Condition("True", reason, f"{progress}; {detail}"),
        "Degraded": NOT_DEGRADED,
    }
    phase = "Loading" if any(p.node for p in pods) else "Pending"
    return TargetState(phase, conditions, fields, None, available)


def _hydrating_state(hydration: Hydration, fields: dict[str, Any], *, serving: bool) -> TargetState:
    """No server pod is asked for until the cache is complete (pods of a previous revision keep serving)."""
    if hydration.failure is not None:
        return TargetState(
            "Degraded" if serving else "Failed", failed(hydration.failure), fields, hydration.failure
        )
    message = f"downloading {hydration.source}"
    if hydration.progress:
        message = f"{message}: {hydration.progress}"
    conditions = {
        "Ready": Condition("False", reasons.DOWNLOADING, message),
        "Progressing": Condition("True", reasons.DOWNLOADING, message),
        "Degraded": NOT_DEGRADED,
    }
    return TargetState("Pending", conditions, fields, None)


def _suspended_state(observation: Observation, fields: dict[str, Any]) -> TargetState:
    remaining = len(observation.pods)
    progressing = (
        Condition("True", reasons.SUSPENDING, f"{remaining} pods still stopping")
        if remaining
        else Condition("False", reasons.SUSPENDED, "no pods run while suspended")
    )
    conditions = {
        "Ready": Condition("False", reasons.SUSPENDED, "spec.suspend is true"),
        "Progressing": progressing,
        "Degraded": NOT_DEGRADED,
    }
    return TargetState("Suspended", conditions, fields, None)


def _idle_state(spec: Eagle3TargetSpec, fields: dict[str, Any]) -> TargetState:
    """Scaled to zero for idleness: settled from the start (its pods' stopping is no progress to report), so
    going idle is one event."""
    return TargetState("Idle", quiet("False", reasons.IDLE, idle_message(spec)), fields, None)


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
    return probe.error if probe is not None and probe.error else NOT_PROBED_YET


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
            found.append(Failure(reasons.ENDPOINT_UNREACHABLE, f"pod {pod.name}: {probe.error}"))
        elif not pod.ready and pod.started and (now - pod.started).total_seconds() > budget:
            # No elapsed time in the message: it would change, and so rewrite the status, on every probe.
            message = (
                f"pod {pod.name} not ready within startupTimeoutSeconds={budget} of {timestamp(pod.started)}"
            )
            found.append(Failure(reasons.STARTUP_TIMEOUT, message))
    if deployment is not None and deployment.failure is not None:
        found.append(deployment.failure)
    return most_actionable(found)
