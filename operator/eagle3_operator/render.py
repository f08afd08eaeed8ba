"""Pure rendering of an Eagle3Target's children (Deployment, Service, PodDisruptionBudget, NetworkPolicy,
PodMonitor, and the hydration Job of a Hugging Face source).

Every function here maps (name, namespace, typed spec) to plain manifest dicts and makes no API call, so the
handlers can server-side apply the result as a whole and tests can check it without a cluster. Applying the
full desired object every time is what repairs drift: a field the operator owns always comes back.
"""

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

from eagle3_target.engines import ENGINES
from eagle3_target.protocol import API_VERSION, KIND

from eagle3_operator.constants import (
    ANNOTATION_RENDERED_DIGEST,
    ANNOTATION_SERVER_IMAGE,
    ANNOTATION_UPGRADE,
    APP_NAME,
    AUTH_MOUNT,
    COMPONENT,
    DEFAULT_CONTAINER_ANNOTATION,
    DOWNLOAD_CONTAINER,
    HYDRATION_COMPONENT,
    HYDRATION_PROGRESS_PORT,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_NAME,
    MANAGED_LABELS,
    MODEL_MOUNT,
    POD_MONITOR_API_VERSION,
    SERVER_CONTAINER,
    SHM_MOUNT,
    WAIT_CONTAINER,
)
from eagle3_operator.spec import Eagle3TargetSpec
from eagle3_operator.spec_pod_settings import GPU_RESOURCE

# The server image new targets that name no image get: the release matching this operator (the operator's
# --server-image overrides it, e.g. for a registry mirror).
DEFAULT_IMAGE = f"ghcr.io/eagle3-dev/eagle3-target:{version('eagle3-target')}"
PORT_NAME = "http"
METRICS_PORT_NAME = "metrics"
# The label the API server puts on every Namespace: NetworkPolicies select namespaces by name with it.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
# The target image's non-root user and group (image/Dockerfile), set explicitly so that runAsNonRoot also
# holds for custom images; fsGroup makes a download cache PVC writable for that user.
RUN_AS_USER = 10001
RUN_AS_GROUP = 0
STARTUP_PERIOD_SECONDS = 10
NAME_LIMIT = 63
_HASH_LENGTH = 8


@dataclass(frozen=True)
class ImagePin:
    """The server image a target runs when spec.image is unset, and the upgrade request that chose it."""

    image: str = DEFAULT_IMAGE
    upgrade: str | None = None


def pin_image(deployment: Mapping[str, Any] | None, upgrade: str | None, operator_image: str) -> ImagePin:
    """Which server image a target keeps: the one its Deployment was rendered with, unless the target asks
    for an upgrade the Deployment has not seen (then the operator's image). `deployment` is the stored one
    (its metadata and spec at least), None when there is none yet."""
    if deployment is None:
        return ImagePin(operator_image, upgrade)
    annotations = (deployment.get("metadata") or {}).get("annotations") or {}
    if annotations.get(ANNOTATION_UPGRADE) != upgrade:
        return ImagePin(operator_image, upgrade)
    pinned = annotations.get(ANNOTATION_SERVER_IMAGE)
    if pinned is None:  # rendered before images were pinned: keep the server image it runs
        containers = ((deployment.get("spec") or {}).get("template") or {}).get("spec", {}).get("containers")
        pinned = next((c.get("image") for c in containers or [] if c.get("name") == SERVER_CONTAINER), None)
    return ImagePin(pinned or operator_image, upgrade)


_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:_HASH_LENGTH]


def _fit(text: str, limit: int = NAME_LIMIT) -> str:
    """`text` if it is a DNS-1035 label within `limit`, else a readable prefix plus a hash of the whole.

    Resource names are DNS subdomains (dots, leading digits, up to 253 characters) but Service names are
    not, so a name that does not fit as is gets a deterministic, collision-resistant stand-in.
    """
    if len(text) <= limit and _DNS_LABEL.match(text):
        return text
    readable = re.sub(r"[^a-z0-9-]", "-", text.lower())
    if not readable[:1].isalpha():
        readable = f"e3t-{readable}"
    readable = readable[: limit - _HASH_LENGTH - 1].rstrip("-")
    return f"{readable}-{_short_hash(text)}"


def child_name(target_name: str) -> str:
    """The one name all of a target's children share (their kinds differ): the target's, when it fits."""
    return _fit(target_name)


@dataclass(frozen=True)
class Neighbours:
    """Namespaces outside a target's spec that its NetworkPolicy admits: the operator's (it probes the
    servers' data port) and Prometheus' (it scrapes the metrics port). None: not known, not admitted."""

    operator_namespace: str | None = None
    prometheus_namespace: str | None = None


def _label_value(target_name: str) -> str:
    """The target's name as a label value: as is when it is one (dots allowed), else the child name."""
    return target_name if _LABEL_VALUE.match(target_name) else child_name(target_name)


def selector_labels(target_name: str) -> dict[str, str]:
    """Labels that pick a target's pods. Only the operator sets them: a Deployment's selector is immutable."""
    return {LABEL_NAME: APP_NAME, LABEL_INSTANCE: _label_value(target_name)}


def label_selector(target_name: str) -> str:
    """`selector_labels` as the string `status.selector` publishes (the scale subresource reads it)."""
    return ",".join(f"{key}={value}" for key, value in sorted(selector_labels(target_name).items()))


def _labels(target_name: str) -> dict[str, str]:
    return {
        **selector_labels(target_name),
        LABEL_COMPONENT: COMPONENT,
        **MANAGED_LABELS,
    }


def owner_reference(target_name: str, uid: str) -> dict[str, Any]:
    """The controller reference every child carries, so deleting the target deletes them."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": target_name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(child_name: str, target_name: str, namespace: str, owner: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": child_name,
        "namespace": namespace,
        "labels": _labels(target_name),
        "ownerReferences": [dict(owner)],
    }


def service_url(name: str, namespace: str, spec: Eagle3TargetSpec) -> str:
    """The stable URL published in status: the external endpoint, or the Service's cluster DNS name."""
    if spec.endpoint is not None:
        return spec.endpoint.url.rstrip("/")
    return f"http://{child_name(name)}.{namespace}.svc:{spec.port}"


def hf_revision(spec: Eagle3TargetSpec) -> str:
    """The revision a huggingFace source downloads: its own, else the model's, else main."""
    return spec.hugging_face.revision or spec.managed_model.revision or "main"


def _hf_model_dir(spec: Eagle3TargetSpec) -> str:
    """Where the download lands in the cache PVC: one directory per repo and revision, so they never mix."""
    return f"{MODEL_MOUNT}/huggingface/{spec.hugging_face.repo}/{hf_revision(spec).replace('/', '--')}"


def model_path(spec: Eagle3TargetSpec) -> str:
    """The `--model` path inside the server container."""
    if spec.source.hugging_face is not None:
        return _hf_model_dir(spec)
    return MODEL_MOUNT


def server_args(spec: Eagle3TargetSpec) -> list[str]:
    """The `eagle3-target serve` command line the spec asks for."""
    model = spec.managed_model
    args = ["eagle3-target", "serve", "--model", model_path(spec), "--engine", spec.engine]
    args += ["--host", "0.0.0.0", "--port", str(spec.port), "--model-name", model.name]
    args += ["--metrics-port", str(spec.monitoring.metrics_port)]
    revision = hf_revision(spec) if spec.source.hugging_face is not None else model.revision
    if revision is not None:
        args += ["--revision", revision]
    if model.dtype is not None:
        args += ["--dtype", model.dtype]
    if spec.aux_layer_ids is not None:
        args += ["--aux-layer-ids", *(str(layer) for layer in spec.aux_layer_ids)]
    if ENGINES[spec.engine].sharded:
        args += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.max_model_len is not None:
        args += ["--max-model-len", str(spec.max_model_len)]
    for key, value in sorted(spec.engine_args.items()):
        args += ["--engine-arg", f"{key}={value}"]
    if spec.auth is not None:
        args += ["--auth-token-file", f"{AUTH_MOUNT}/{spec.auth.token_secret_ref.key}"]
    if model.trust_remote_code:
        args.append("--trust-remote-code")
    return args


# The server flags that decide which model a pod serves, and so its /v1/info fingerprint; the others only
# tune how it is served.
MODEL_IDENTITY_FLAGS = frozenset(
    {"--model", "--engine", "--model-name", "--revision", "--dtype", "--aux-layer-ids"}
)


def model_identity(command: Sequence[str]) -> tuple[str, ...]:
    """The model-deciding part of a server command line: its identity flags with their values, in order.

    Pods whose commands share it serve the same model, so old pods of a rollout that keeps the model still
    serve the current generation's model. (Flag values never start with "--".)
    """
    kept: list[str] = []
    keep = False
    for arg in command:
        if arg.startswith("--"):
            keep = arg in MODEL_IDENTITY_FLAGS
        if keep:
            kept.append(arg)
    return tuple(kept)


def _resources(spec: Eagle3TargetSpec) -> dict[str, Any]:
    requests = dict(spec.resources.requests)
    limits = dict(spec.resources.limits)
    if spec.tensor_parallel_size > 0:
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = spec.tensor_parallel_size
    return {key: value for key, value in (("requests", requests), ("limits", limits)) if value}


def _probe(path: str, *, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _model_volume(spec: Eagle3TargetSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model volume and the server's read-only mount of it, per source."""
    source = spec.source
    mount: dict[str, Any] = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
    if source.pvc is not None:
        claim = {"claimName": source.pvc.claim_name, "readOnly": True}
        volume = {"name": "model", "persistentVolumeClaim": claim}
        if source.pvc.sub_path:
            mount["subPath"] = source.pvc.sub_path
    elif source.host_path is not None:
        volume = {"name": "model", "hostPath": {"path": source.host_path.path, "type": "Directory"}}
    else:
        claim = {"claimName": spec.hugging_face.cache_claim_name}
        volume = {"name": "model", "persistentVolumeClaim": claim}
    return volume, mount


def _download_container(spec: Eagle3TargetSpec, image: str) -> dict[str, Any]:
    """The hydration Job's container: `eagle3-target hydrate` fills the cache claim from the Hub, keeping
    files already there, and marks the directory complete only once every file is whole."""
    source = spec.hugging_face
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": f"{MODEL_MOUNT}/.hf-home"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    ]
    if source.token_secret_ref is not None:
        ref = source.token_secret_ref
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return {
        "name": DOWNLOAD_CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        # original/ holds the checkpoint again in Meta's format, which transformers and vLLM never read.
        "command": [
            *("eagle3-target", "hydrate", "--repo", source.repo, "--revision", hf_revision(spec)),
            *("--local-dir", _hf_model_dir(spec), "--exclude", "original/*"),
            *("--progress-port", str(HYDRATION_PROGRESS_PORT)),
        ],
        "env": env,
        "ports": [{"name": "progress", "containerPort": HYDRATION_PROGRESS_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        "volumeMounts": [{"name": "model", "mountPath": MODEL_MOUNT}],
        # The Hub's refusal (a gated repo, a bad token, a missing revision) is the termination message;
        # a crash before it could write one leaves the tail of the log instead.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
    }


def _wait_container(spec: Eagle3TargetSpec, image: str) -> dict[str, Any]:
    """Init container of every server pod: it holds the server back until the hydration Job has marked the
    download complete, so a half-downloaded model is never loaded."""
    return {
        "name": WAIT_CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["eagle3-target", "wait-for-model", "--local-dir", _hf_model_dir(spec)],
        "volumeMounts": [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
        "securityContext": _container_security(),
    }


def _placement_and_pulls(spec: Eagle3TargetSpec) -> dict[str, Any]:
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


def _hydration_job_spec(name: str, spec: Eagle3TargetSpec, pin: ImagePin) -> dict[str, Any]:
    image = spec.image or pin.image
    pod: dict[str, Any] = {
        # Never: a failed attempt stays as a pod whose termination message says why; the Job retries.
        "restartPolicy": "Never",
        "containers": [_download_container(spec, image)],
        "volumes": [_model_volume(spec)[0]],
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": _pod_security(spec),
        **_placement_and_pulls(spec),
    }
    labels = {LABEL_INSTANCE: _label_value(name), LABEL_COMPONENT: HYDRATION_COMPONENT, **MANAGED_LABELS}
    return {
        "backoffLimit": 4,
        # Exit 2 (no such repository or revision, no access): retrying cannot help, fail the Job at once.
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {"containerName": DOWNLOAD_CONTAINER, "operator": "In", "values": [2]},
                }
            ]
        },
        "template": {"metadata": {"labels": labels}, "spec": pod},
    }


def hydration_job_name(name: str, spec: Eagle3TargetSpec, pin: ImagePin = ImagePin()) -> str | None:
    """The hydration Job's name for this spec (None without a huggingFace source). It changes with what the
    Job would do, because a Job's pod template cannot change: a new source, revision, claim or image gets a
    new Job, which finds a snapshot that is already complete marked and ends at once."""
    if spec.model is None or spec.model.source is None or spec.model.source.hugging_face is None:
        return None
    digest = _short_hash(json.dumps(_hydration_job_spec(name, spec, pin), sort_keys=True))
    return _fit(f"{child_name(name)[: NAME_LIMIT - 2 * _HASH_LENGTH - 11]}-hydrate-{digest}")


def build_hydration_job(
    name: str, namespace: str, spec: Eagle3TargetSpec, owner: dict[str, Any], pin: ImagePin = ImagePin()
) -> dict[str, Any] | None:
    """One download per (repository, revision, cache claim): a Job that fills the claim for every replica."""
    job_name = hydration_job_name(name, spec, pin)
    if job_name is None:
        return None
    metadata = _metadata(job_name, name, namespace, owner)
    metadata["labels"][LABEL_COMPONENT] = HYDRATION_COMPONENT
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata,
        "spec": _hydration_job_spec(name, spec, pin),
    }


def _pod_security(spec: Eagle3TargetSpec) -> dict[str, Any]:
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
    model_volume, model_mount = _model_volume(spec)
    shm = {"medium": "Memory", "sizeLimit": spec.shm_size}
    volumes = [model_volume, {"name": "dshm", "emptyDir": shm}]
    mounts = [model_mount, {"name": "dshm", "mountPath": SHM_MOUNT}]
    if spec.auth is not None:
        volumes.append({"name": "auth", "secret": {"secretName": spec.auth.token_secret_ref.name}})
        mounts.append({"name": "auth", "mountPath": AUTH_MOUNT, "readOnly": True})
    volumes += [volume.model_dump(by_alias=True, exclude_none=True) for volume in spec.volumes]
    mounts += [mount.model_dump(by_alias=True, exclude_none=True) for mount in spec.volume_mounts]
    env = [{"name": "HF_HUB_OFFLINE", "value": "1"}]
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
        "securityContext": _container_security(),
    }
    pod: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        # The server never talks to the API server, and service-link variables could shadow its
        # EAGLE3_TARGET_* settings (a Service named eagle3-target yields EAGLE3_TARGET_PORT).
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": _pod_security(spec),
    }
    if spec.source.hugging_face is not None:
        pod["initContainers"] = [_wait_container(spec, image)]
    pod |= _placement_and_pulls(spec)
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
) -> dict[str, Any]:
    """One pod per replica. By default updates replace pods one at a time without surging: GPUs are the
    constraint (spec.rollout changes that where spare GPUs are certain). Until the model cache is hydrated
    no pod is asked for: it would only hold its GPUs while it waits."""
    rollout = {"maxSurge": spec.rollout.max_surge, "maxUnavailable": spec.rollout.max_unavailable}
    metadata = _metadata(child_name(name), name, namespace, owner)
    metadata["annotations"] = {ANNOTATION_SERVER_IMAGE: pin.image}
    if pin.upgrade is not None:
        metadata["annotations"][ANNOTATION_UPGRADE] = pin.upgrade
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": spec.effective_replicas if hydrated else 0,
            "selector": {"matchLabels": selector_labels(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rollout},
            "revisionHistoryLimit": 3,
            # Past the startup budget plus scheduling slack the Deployment reports ProgressDeadlineExceeded.
            "progressDeadlineSeconds": spec.startup_timeout_seconds + 300,
            "template": {
                "metadata": {
                    # The spec's own labels first: the operator's (which its selectors rely on) win.
                    "labels": {**spec.pod_metadata.labels, **_labels(name)},
                    "annotations": {
                        **spec.pod_metadata.annotations,
                        DEFAULT_CONTAINER_ANNOTATION: SERVER_CONTAINER,
                    },
                },
                "spec": _pod_spec(name, spec, pin),
            },
        },
    }


def build_service(name: str, namespace: str, spec: Eagle3TargetSpec, owner: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(child_name(name), name, namespace, owner),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name),
            "ports": [
                {
                    "name": PORT_NAME,
                    "port": spec.port,
                    "targetPort": PORT_NAME,
                    "protocol": "TCP",
                    "appProtocol": "http",
                }
            ],
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
        "metadata": _metadata(child_name(name), name, namespace, owner),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(name)},
            # A pod still loading its model serves nothing yet; it must not block a node drain.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def build_pod_monitor(
    name: str, namespace: str, spec: Eagle3TargetSpec, owner: dict[str, Any]
) -> dict[str, Any] | None:
    """A prometheus-operator PodMonitor on the server's metrics port (no token needed), when asked for."""
    monitor = spec.monitoring.pod_monitor
    if not monitor.enabled:
        return None
    metadata = _metadata(child_name(name), name, namespace, owner)
    metadata["labels"] = {**monitor.labels, **metadata["labels"]}
    return {
        "apiVersion": POD_MONITOR_API_VERSION,
        "kind": "PodMonitor",
        "metadata": metadata,
        "spec": {
            "selector": {"matchLabels": selector_labels(name)},
            "podMetricsEndpoints": [
                {"port": METRICS_PORT_NAME, "path": "/metrics", "interval": monitor.interval}
            ],
        },
    }


def _namespaces(names: list[str]) -> dict[str, Any]:
    return {
        "namespaceSelector": {
            "matchExpressions": [{"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": names}]
        }
    }


def build_network_policy(
    name: str, namespace: str, spec: Eagle3TargetSpec, owner: dict[str, Any], neighbours: Neighbours
) -> dict[str, Any] | None:
    """Ingress to the server pods, when asked for: the data port from the operator's namespace and the
    spec's namespaces, the metrics port from Prometheus' namespace, nothing else. A rule with no peers
    is left out rather than rendered empty, because an empty `from` admits everyone."""
    policy = spec.network_policy
    if not policy.enabled:
        return None
    data_from = []
    names = sorted({*policy.allowed_namespaces, *filter(None, [neighbours.operator_namespace])})
    if names:
        data_from.append(_namespaces(names))
    if policy.namespace_selector is not None:
        selector = policy.namespace_selector.model_dump(by_alias=True, exclude_defaults=True)
        data_from.append({"namespaceSelector": selector})
    ingress = []
    if data_from:
        ingress.append({"from": data_from, "ports": [{"protocol": "TCP", "port": PORT_NAME}]})
    if neighbours.prometheus_namespace:
        scrapers = [_namespaces([neighbours.prometheus_namespace])]
        ingress.append({"from": scrapers, "ports": [{"protocol": "TCP", "port": METRICS_PORT_NAME}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(child_name(name), name, namespace, owner),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(name)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def stamp_digest(manifest: dict[str, Any]) -> dict[str, Any]:
    """`manifest` with ANNOTATION_RENDERED_DIGEST set to the digest of everything else in it."""
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    metadata = manifest["metadata"]
    metadata["annotations"] = {**metadata.get("annotations", {}), ANNOTATION_RENDERED_DIGEST: digest}
    return manifest


def rendered_digest(child: Mapping[str, Any]) -> str | None:
    """The digest stamped on a child (rendered or as stored), if any."""
    return ((child.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_RENDERED_DIGEST)


def build_children(
    name: str,
    namespace: str,
    uid: str,
    spec: Eagle3TargetSpec,
    *,
    pod_monitor_supported: bool,
    neighbours: Neighbours = Neighbours(),
    hydrated: bool = True,
    pin: ImagePin = ImagePin(),
) -> list[dict[str, Any]]:
    """Everything the target should own now, each stamped with its digest; an owned kind missing from the
    list should be deleted.

    `hydrated`: whether a huggingFace source's hydration Job has completed (always true for other sources).
    """
    if spec.external:
        return []
    owner = owner_reference(name, uid)
    deployment = build_deployment(name, namespace, spec, owner, pin, hydrated=hydrated)
    children = [deployment, build_service(name, namespace, spec, owner)]
    optional = [
        build_hydration_job(name, namespace, spec, owner, pin),
        build_pdb(name, namespace, spec, owner),
        build_network_policy(name, namespace, spec, owner, neighbours),
    ]
    if pod_monitor_supported:
        optional.append(build_pod_monitor(name, namespace, spec, owner))
    return [stamp_digest(child) for child in children + optional if child is not None]
