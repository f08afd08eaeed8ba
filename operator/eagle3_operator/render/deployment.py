"""The server pods: the Deployment that runs one per replica (its pod template: the server container, its
probes, volumes and scheduling) and the PodDisruptionBudget that paces their evictions."""

import math
from typing import Any

from eagle3_operator.constants import (
    ANNOTATION_SERVER_IMAGE,
    ANNOTATION_SERVER_IMAGE_VARIANT,
    ANNOTATION_UPGRADE,
    AUTH_MOUNT,
    DEFAULT_CONTAINER_ANNOTATION,
    SERVER_CONTAINER,
    SHM_MOUNT,
)
from eagle3_operator.render.hydration import wait_container
from eagle3_operator.render.model_source import model_volume
from eagle3_operator.render.names import child_labels, child_metadata, child_name, selector_labels
from eagle3_operator.render.network import METRICS_PORT_NAME, PORT_NAME
from eagle3_operator.render.pod_parts import (
    SCRATCH_ENV,
    SCRATCH_VOLUME,
    SCRATCH_VOLUME_MOUNT,
    container_security,
    placement_and_pulls,
    pod_security,
    with_ephemeral_storage,
)
from eagle3_operator.render.server_command import server_args
from eagle3_operator.render.server_image import ImagePin
from eagle3_operator.spec import Eagle3TargetSpec
from eagle3_operator.spec_pod_settings import GPU_RESOURCE

STARTUP_PERIOD_SECONDS = 10
# Defaults where spec.resources names no ephemeral-storage: logs plus the engines' compile caches.
SERVER_EPHEMERAL_REQUEST = "1Gi"
SERVER_EPHEMERAL_LIMIT = "20Gi"


def _resources(spec: Eagle3TargetSpec) -> dict[str, Any]:
    requests = dict(spec.resources.requests)
    limits = dict(spec.resources.limits)
    if spec.tensor_parallel_size > 0:
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = spec.tensor_parallel_size
    # No CPU limit on a GPU server (README, kube-score): throttling its engine's host threads stalls GPUs.
    rendered = {key: value for key, value in (("requests", requests), ("limits", limits)) if value}
    return with_ephemeral_storage(rendered, SERVER_EPHEMERAL_REQUEST, SERVER_EPHEMERAL_LIMIT)


def _probe(path: str, *, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _topology_spread(name: str, spec: Eagle3TargetSpec) -> list[dict[str, Any]]:
    """The spec's constraints; one without a labelSelector spreads this target's own pods."""
    constraints = []
    for constraint in spec.topology_spread_constraints:
        rendered = constraint.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True)
        rendered.setdefault("labelSelector", {"matchLabels": selector_labels(name)})
        constraints.append(rendered)
    return constraints


def _pod_spec(name: str, spec: Eagle3TargetSpec, pin: ImagePin) -> dict[str, Any]:
    image = spec.image or pin.image
    source_volume, model_mount = model_volume(spec)
    shm = {"medium": "Memory", "sizeLimit": spec.shm_size}
    volumes = [source_volume, {"name": "dshm", "emptyDir": shm}, SCRATCH_VOLUME]
    mounts = [model_mount, {"name": "dshm", "mountPath": SHM_MOUNT}, SCRATCH_VOLUME_MOUNT]
    if spec.auth is not None:
        volumes.append({"name": "auth", "secret": {"secretName": spec.auth.token_secret_ref.name}})
        mounts.append({"name": "auth", "mountPath": AUTH_MOUNT, "readOnly": True})
    volumes += [volume.model_dump(by_alias=True, exclude_none=True) for volume in spec.volumes]
    mounts += [mount.model_dump(by_alias=True, exclude_none=True) for mount in spec.volume_mounts]
    env = [{"name": "HF_HUB_OFFLINE", "value": "1"}, *SCRATCH_ENV]
    env += [var.model_dump(by_alias=True, exclude_none=True) for var in spec.env]
    container = {
        "name": SERVER_CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": server_args(spec),
        # The model is already local; this keeps transformers from reaching for the Hub at load time.
        "env": env,
        "ports": [
            {"name": PORT_NAME, "containerPort": spec.port, "protocol": "TCP"},
            {"name": METRICS_PORT_NAME, "containerPort": spec.monitoring.metrics_port, "protocol": "TCP"},
        ],
        "resources": _resources(spec),
        "volumeMounts": mounts,
        "startupProbe": _probe(
            "/readyz",
            period=STARTUP_PERIOD_SECONDS,
            failures=math.ceil(spec.startup_timeout_seconds / STARTUP_PERIOD_SECONDS),
        ),
        "readinessProbe": _probe("/readyz", period=5, failures=3),
        "livenessProbe": _probe("/healthz", period=10, failures=6),
        # A server that cannot load writes why to /dev/termination-log and exits; one that dies before it
        # can (a crash, a usage error) still leaves the tail of its log as the container's message.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security(),
    }
    pod: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        # The server never talks to the API server, and service-link variables could shadow its
        # EAGLE3_TARGET_* settings (a Service named eagle3-target yields EAGLE3_TARGET_PORT).
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security(spec),
    }
    if spec.source.hugging_face is not None:
        pod["initContainers"] = [wait_container(spec, image)]
    pod |= placement_and_pulls(spec)
    if spec.affinity:
        pod["affinity"] = spec.affinity
    if spec.priority_class_name:
        pod["priorityClassName"] = spec.priority_class_name
    if spec.runtime_class_name:
        pod["runtimeClassName"] = spec.runtime_class_name
    if spec.service_account_name:
        # The API server copies serviceAccountName into the deprecated serviceAccount and back; applying both
        # is what lets a later apply without them remove the account again.
        pod["serviceAccountName"] = pod["serviceAccount"] = spec.service_account_name
    if spec.scheduler_name:
        pod["schedulerName"] = spec.scheduler_name
    if spec.topology_spread_constraints:
        pod["topologySpreadConstraints"] = _topology_spread(name, spec)
    return pod


def build_deployment(
    name: str,
    namespace: str,
    spec: Eagle3TargetSpec,
    owner: dict[str, Any],
    pin: ImagePin = ImagePin(),
    *,
    hydrated: bool = True,
    idle: bool = False,
) -> dict[str, Any]:
    """One pod per replica. By default updates replace pods one at a time without surging: GPUs are the
    constraint (spec.rollout changes that where spare GPUs are certain). Until the model cache is hydrated
    no pod is asked for: it would only hold its GPUs while it waits; nor while the target is idle
    (status/idle.py)."""
    rollout = {"maxSurge": spec.rollout.max_surge, "maxUnavailable": spec.rollout.max_unavailable}
    metadata = child_metadata(child_name(name), name, namespace, owner)
    metadata["annotations"] = {ANNOTATION_SERVER_IMAGE: pin.image}
    if pin.variant:
        metadata["annotations"][ANNOTATION_SERVER_IMAGE_VARIANT] = pin.variant
    if pin.upgrade is not None:
        metadata["annotations"][ANNOTATION_UPGRADE] = pin.upgrade
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": spec.effective_replicas if hydrated and not idle else 0,
            "selector": {"matchLabels": selector_labels(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rollout},
            "revisionHistoryLimit": 3,
            # Past the startup budget plus scheduling slack the Deployment reports ProgressDeadlineExceeded.
            "progressDeadlineSeconds": spec.startup_timeout_seconds + 300,
            "template": {
                "metadata": {
                    # The spec's own labels first: the operator's (which its selectors rely on) win.
                    "labels": {**spec.pod_metadata.labels, **child_labels(name)},
                    "annotations": {
                        **spec.pod_metadata.annotations,
                        DEFAULT_CONTAINER_ANNOTATION: SERVER_CONTAINER,
                    },
                },
                "spec": _pod_spec(name, spec, pin),
            },
        },
    }


def build_pdb(
    name: str, namespace: str, spec: Eagle3TargetSpec, owner: dict[str, Any]
) -> dict[str, Any] | None:
    """Evictions take one replica at a time; for a single replica a budget would only block node drains."""
    if spec.effective_replicas < 2:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(child_name(name), name, namespace, owner),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(name)},
            # A pod still loading its model serves nothing yet; it must not block a node drain.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
