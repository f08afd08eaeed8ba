"""What the server pods and the hydration Job's download pod share: their security contexts, the nodes they
may run on and the secrets they pull the image with. One definition keeps the two pods from drifting apart
(the download must run wherever the server may, under the same restrictions)."""

from typing import Any

from kubernetes.utils import parse_quantity

from eagle3_operator.constants import SCRATCH_MOUNT
from eagle3_operator.spec import Eagle3TargetSpec

# The target image's non-root user and group (image/Dockerfile), set explicitly so that runAsNonRoot also
# holds for custom images; fsGroup makes a download cache PVC writable for that user.
RUN_AS_USER = 10001
RUN_AS_GROUP = 0
EPHEMERAL_STORAGE = "ephemeral-storage"


def container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


SCRATCH_VOLUME: dict[str, Any] = {"name": "scratch", "emptyDir": {}}
SCRATCH_VOLUME_MOUNT: dict[str, Any] = {"name": "scratch", "mountPath": SCRATCH_MOUNT}
# Before the spec's own env, so a target may still point HOME elsewhere (a cache volume of its own).
SCRATCH_ENV: list[dict[str, Any]] = [
    {"name": "HOME", "value": SCRATCH_MOUNT},
    {"name": "TMPDIR", "value": SCRATCH_MOUNT},
]


def with_ephemeral_storage(resources: dict[str, Any], request: str, limit: str) -> dict[str, Any]:
    """RESOURCES with an ephemeral-storage request and limit (the scratch emptyDir and the container's logs
    count against it, so a runaway cache evicts this pod, not its node's neighbours) unless already set.
    A default that would cross the value set beside it (a limit below the request makes the pod invalid) is
    left out: a request alone is then unbounded, and a limit alone is its own request."""
    requests, limits = dict(resources.get("requests", {})), dict(resources.get("limits", {}))
    own_request, own_limit = requests.get(EPHEMERAL_STORAGE), limits.get(EPHEMERAL_STORAGE)
    if own_limit is None and (own_request is None or parse_quantity(own_request) <= parse_quantity(limit)):
        limits = {EPHEMERAL_STORAGE: limit, **limits}
    if own_request is None and (own_limit is None or parse_quantity(own_limit) >= parse_quantity(request)):
        requests = {EPHEMERAL_STORAGE: request, **requests}
    bounds = {key: value for key, value in (("requests", requests), ("limits", limits)) if value}
    return {**resources, **bounds}


def pod_security(spec: Eagle3TargetSpec) -> dict[str, Any]:
    """Non-root with the runtime's seccomp profile always; the ids are the image's unless the spec says
    otherwise, and none at all when the platform assigns them (OpenShift's restricted SCC)."""
    ids = spec.security_context
    security: dict[str, Any] = {"runAsNonRoot": True}
    if not ids.platform_assigned_ids:
        security |= {
            "runAsUser": ids.run_as_user if ids.run_as_user is not None else RUN_AS_USER,
            "runAsGroup": ids.run_as_group if ids.run_as_group is not None else RUN_AS_GROUP,
            "fsGroup": ids.fs_group if ids.fs_group is not None else RUN_AS_USER,
        }
    # Model volumes hold hundreds of GB; never chown them recursively on every start.
    security["fsGroupChangePolicy"] = "OnRootMismatch"
    security["seccompProfile"] = {"type": "RuntimeDefault"}
    return security


def placement_and_pulls(spec: Eagle3TargetSpec) -> dict[str, Any]:
    """What the server pods and the download pod share: the nodes they may run on (on clusters whose every
    node is tainted for GPUs, the download needs the tolerations too) and the secrets to pull the image."""
    shared: dict[str, Any] = {}
    if spec.node_selector:
        shared["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        shared["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations]
    if spec.image_pull_secrets:
        shared["imagePullSecrets"] = [{"name": ref.name} for ref in spec.image_pull_secrets]
    return shared
