"""Reading the API's objects into the views status needs: pods (their scheduling, container states and
exits), the hydration Job and its pods, and the Deployment.

This is where Kubernetes' shapes are known (which waiting reasons will not clear, which exit codes mean the
server gave up, which pods are finished), so the rules in `state` see only a reason and a message. Pure:
the reconciler fetches the objects and passes them in.
"""

from collections.abc import Iterable, Mapping
from typing import Any

from eagle3_target.protocol import (
    EXIT_ENGINE_FAILED,
    EXIT_INVALID_SETTINGS,
    EXIT_LOAD_FAILED,
    HydrationProgress,
)

from eagle3_operator.constants import (
    DOWNLOAD_CONTAINER,
    HYDRATION_COMPONENT,
    LABEL_COMPONENT,
    SERVER_CONTAINER,
    WAIT_CONTAINER,
)
from eagle3_operator.render.server_command import model_identity
from eagle3_operator.status import reasons
from eagle3_operator.status.observation import (
    EPOCH,
    DeploymentView,
    Failure,
    Hydration,
    JobView,
    PodView,
    parse_timestamp,
)

# Container waiting reasons that will not clear on their own, mapped to the reason the status reports.
WAITING_FAILURES = {
    "ErrImagePull": reasons.IMAGE_PULL_BACK_OFF,
    "ImagePullBackOff": reasons.IMAGE_PULL_BACK_OFF,
    "InvalidImageName": reasons.IMAGE_PULL_BACK_OFF,
    "CrashLoopBackOff": reasons.CRASH_LOOP_BACK_OFF,
    "CreateContainerConfigError": reasons.CREATE_CONTAINER_CONFIG_ERROR,
    "CreateContainerError": reasons.CREATE_CONTAINER_ERROR,
}
# Exits that explain why a pod does not serve, with the reason the status reports: the server's codes for
# giving up (each with one line saying why: it could not load the model, or its loaded engine died), and
# any failed download (its message is its log's tail: terminationMessagePolicy in render/hydration.py).
SERVER_EXIT_REASONS = {
    EXIT_INVALID_SETTINGS: reasons.MODEL_LOAD_FAILED,
    EXIT_LOAD_FAILED: reasons.MODEL_LOAD_FAILED,
    EXIT_ENGINE_FAILED: reasons.ENGINE_FAILED,
}
# Server pods in these phases are finished (evicted, refused by the kubelet's admission, shut down with
# their node, or exited): the ReplicaSet has replaced them, so they are neither endpoints nor replicas.
FINISHED_POD_PHASES = frozenset({"Failed", "Succeeded"})


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
        why = failed.get("reason") or "Failed"
        failure = Failure(
            reasons.MODEL_DOWNLOAD_FAILED, f"{why}: {failed.get('message') or 'the download Job failed'}"
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
        failure = Failure(reasons.MODEL_DOWNLOAD_FAILED, said.message) if said is not None else job.failure
        return Hydration(source, complete=False, failure=failure)
    stuck = next(((p, p.failure) for p in pods if not p.finished and p.failure is not None), None)
    if stuck is not None:
        pod, why = stuck
        failure = Failure(why.reason, f"hydration pod {pod.name}: {why.message}")
        return Hydration(source, complete=False, failure=failure)
    return Hydration(source, complete=False, progress=progress)


def _pod_failure(scheduled: Mapping[str, Any], status: Mapping[str, Any]) -> Failure | None:
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        return Failure(reasons.UNSCHEDULABLE, scheduled.get("message") or "no node fits the pod")
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
            reasons.OOM_KILLED, f"{exited}: killed at its memory limit; raise spec.resources.limits.memory"
        )
    reason = {
        SERVER_CONTAINER: SERVER_EXIT_REASONS.get(code),
        DOWNLOAD_CONTAINER: reasons.MODEL_DOWNLOAD_FAILED,
    }.get(name)
    if reason is None:
        return None
    return Failure(reason, f"{said} ({exited})" if said else exited)


def deployment_view(deployment: Mapping[str, Any]) -> DeploymentView:
    metadata, spec, status = (deployment.get(k) or {} for k in ("metadata", "spec", "status"))
    failure = None
    for condition in status.get("conditions") or []:
        if condition.get("type") == "ReplicaFailure" and condition.get("status") == "True":
            failure = Failure(reasons.REPLICA_FAILURE, condition.get("message") or "pods cannot be created")
        elif condition.get("reason") == "ProgressDeadlineExceeded" and failure is None:
            failure = Failure(
                reasons.PROGRESS_DEADLINE_EXCEEDED, condition.get("message") or "rollout timed out"
            )
    return DeploymentView(
        generation=metadata.get("generation", 0),
        observed_generation=status.get("observedGeneration", 0),
        desired=spec.get("replicas", 1),
        replicas=status.get("replicas", 0),
        ready_replicas=status.get("readyReplicas", 0),
        updated_replicas=status.get("updatedReplicas", 0),
        failure=failure,
    )
