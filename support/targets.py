"""Eagle3Target objects for tests and benchmarks: manifests, one namespace's targets and their children, and
statuses written by hand where no operator runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import kubernetes
from eagle3_target.protocol import ANNOTATION_WAKE_REQUESTED, API_VERSION, GROUP, PLURAL, VERSION

from support.cluster import nodes
from support.cluster.access import Cluster

T = TypeVar("T")

# The model block of a hand-written status: the tiny Llama the tests serve.
MODEL_STATUS = {
    "name": "tiny-llama",
    "revision": "r1",
    "dtype": "float32",
    "engine": "hf",
    "numHiddenLayers": 8,
    "hiddenSize": 64,
    "vocabSize": 256,
    "auxLayerIds": [1, 3, 4],
    "fingerprint": "fp-123",
}

# Every pod setting of the spec at once (the names exist where the tests create them: the RuntimeClass,
# the ServiceAccount), for the rendering's dry run and the operator's round trip.
POD_SETTINGS: dict[str, Any] = {
    "env": [
        {"name": "NCCL_DEBUG", "value": "INFO"},
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ],
    "volumes": [{"name": "compile-cache", "emptyDir": {"sizeLimit": "10Gi"}}],
    "volumeMounts": [{"name": "compile-cache", "mountPath": "/cache"}],
    "podMetadata": {"labels": {"kueue.x-k8s.io/queue-name": "gpus"}, "annotations": {"team": "ml"}},
    "runtimeClassName": "e3t-test-runtime",
    "serviceAccountName": "bucket-reader",
    "schedulerName": "gang-scheduler",
    "topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}
    ],
    "shmSize": "32Gi",
    "securityContext": {"platformAssignedIds": True},
    "rollout": {"maxSurge": 1, "maxUnavailable": 0},
}


def target_manifest(name: str, port: int, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "Eagle3Target",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "tiny-llama", "source": {"hostPath": {"path": "/models/tiny-llama"}}},
            "engine": "hf",
            "tensorParallelSize": 1,
            "replicas": 1,
            "port": port,
            "startupTimeoutSeconds": 600,
        }
        | spec,
    }


def kubelet_target_manifest(name: str, model_dir: Path, **spec: Any) -> dict[str, Any]:
    """A target whose one pod the test kubelet runs (support/kubelet.py), serving `model_dir` (a hostPath)
    with the hf engine."""
    return {
        "apiVersion": API_VERSION,
        "kind": "Eagle3Target",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "tiny-llama", "source": {"hostPath": {"path": str(model_dir)}}},
            "engine": "hf",
            "tensorParallelSize": 1,
            "replicas": 1,
            "port": 18000,
            **nodes.kubelet_placement(),
        }
        | spec,
    }


def unless_missing(read: Callable[[], T]) -> T | None:
    """What `read` returns, or None where the API server answers 404."""
    try:
        return read()
    except kubernetes.client.ApiException as error:
        if error.status == 404:
            return None
        raise


class Targets:
    """Eagle3Target and child access for one namespace."""

    def __init__(self, cluster: Cluster, namespace: str) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.custom = kubernetes.client.CustomObjectsApi(cluster.api_client)
        self.core = kubernetes.client.CoreV1Api(cluster.api_client)
        self.apps = kubernetes.client.AppsV1Api(cluster.api_client)

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        return cast(
            dict[str, Any],
            self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, manifest),
        )

    def get(self, name: str) -> dict[str, Any] | None:
        body = unless_missing(
            lambda: self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)
        )
        return cast(dict[str, Any] | None, body)

    def status(self, name: str) -> dict[str, Any]:
        """The target's status: empty before the operator's first write, or once the target is gone."""
        return cast(dict[str, Any], (self.get(name) or {}).get("status") or {})

    def status_with_reason(self, name: str, reason: str, kind: str = "Ready") -> dict[str, Any] | None:
        """The target's status once its `kind` condition has `reason`, else None (for `eventually`)."""
        status = self.status(name)
        return status if condition(status, kind).get("reason") == reason else None

    def patch_spec(self, name: str, spec: dict[str, Any]) -> int:
        """Merge-patch the spec; returns the new metadata.generation."""
        body = self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name, {"spec": spec}
        )
        return cast(dict[str, Any], body)["metadata"]["generation"]

    def delete(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)

    def deployment(self, name: str) -> kubernetes.client.V1Deployment | None:
        return unless_missing(lambda: self.apps.read_namespaced_deployment(name, self.namespace))

    def service(self, name: str) -> kubernetes.client.V1Service | None:
        return unless_missing(lambda: self.core.read_namespaced_service(name, self.namespace))

    def pdb(self, name: str) -> kubernetes.client.V1PodDisruptionBudget | None:
        policy = kubernetes.client.PolicyV1Api(self.cluster.api_client)
        return unless_missing(lambda: policy.read_namespaced_pod_disruption_budget(name, self.namespace))

    def pods(self, name: str) -> list[kubernetes.client.V1Pod]:
        """The target's server pods (its Service's selector; hydration pods carry only the instance label)."""
        selector = f"app.kubernetes.io/name=eagle3-target,app.kubernetes.io/instance={name}"
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
        return [p for p in pods if p.metadata is None or p.metadata.deletion_timestamp is None]

    def events(self, name: str) -> list[kubernetes.client.CoreV1Event]:
        selector = f"involvedObject.name={name},involvedObject.kind=Eagle3Target"
        return self.core.list_namespaced_event(self.namespace, field_selector=selector).items

    def ready_status(
        self, name: str, generation: int | None = None, replicas: int | None = None
    ) -> dict | None:
        """The status once Ready=True for `generation` (default: the current one) with `replicas` serving."""
        body = self.get(name)
        if body is None:
            return None
        status = body.get("status") or {}
        ready = condition(status, "Ready")
        generation = generation or body["metadata"]["generation"]
        if ready.get("status") != "True" or ready.get("observedGeneration") != generation:
            return None
        if status.get("observedGeneration") != generation:
            return None
        if replicas is not None and status.get("readyReplicas") != replicas:
            return None
        return status


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def create_target(objects: kubernetes.client.CustomObjectsApi, namespace: str, name: str) -> dict[str, Any]:
    """A target no operator serves, for tests that write its status by hand."""
    manifest = target_manifest(name, 8000)
    return cast(
        dict[str, Any], objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)
    )


def write_status(
    objects: kubernetes.client.CustomObjectsApi, namespace: str, name: str, status: dict[str, Any]
) -> None:
    """Write a status as the operator would (the status subresource)."""
    objects.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name, {"status": status})


def target_status(
    generation: int, ready: str, reason: str, *, ready_generation: int | None = None, port: int = 8000
) -> dict[str, Any]:
    """A status as the operator writes it: the Ready condition, two endpoints (one ready) and the model."""
    condition_generation = generation if ready_generation is None else ready_generation
    return {
        "observedGeneration": generation,
        "phase": "Ready" if ready == "True" else "Loading",
        "conditions": [
            {
                "type": "Ready",
                "status": ready,
                "reason": reason,
                "message": f"{reason} at generation {generation}",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
                "observedGeneration": condition_generation,
            }
        ],
        "url": f"http://tiny.ns.svc:{port}",
        "endpoints": [
            {"pod": "tiny-0", "address": f"http://127.0.0.2:{port}", "ready": True, "node": "n0"},
            {"pod": "tiny-1", "address": f"http://127.0.0.3:{port}", "ready": False, "node": "n1"},
        ],
        "model": MODEL_STATUS,
    }


def wake_annotation(objects: kubernetes.client.CustomObjectsApi, namespace: str, name: str) -> str | None:
    """The target's wake annotation (resolve() writes it to wake an idle target)."""
    body = cast(dict[str, Any], objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name))
    return (body["metadata"].get("annotations") or {}).get(ANNOTATION_WAKE_REQUESTED)
