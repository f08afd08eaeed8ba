"""What the spec asks for reaches the cluster and leaves with it: pod settings in the Deployment's pod
template, the NetworkPolicy, and the PodMonitor where its CRD exists.

One operator process serves the whole module (only this module's namespaces); each test has its own.
"""

from __future__ import annotations

from typing import Any

import kubernetes
import pytest

from support.cluster.waiting import eventually, free_port
from support.operator_process import OperatorProcess
from support.targets import POD_SETTINGS, Targets, target_manifest

pytestmark = pytest.mark.usefixtures("operator")


POD_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "podmonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {"kind": "PodMonitor", "plural": "podmonitors", "singular": "podmonitor"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                },
            }
        ],
    },
}


def test_pod_monitor_follows_the_spec_where_its_crd_exists(targets: Targets, operator: OperatorProcess):
    """Only prometheus-operator's PodMonitor CRD is needed (a stand-in with its group, version and names)."""
    extensions = kubernetes.client.ApiextensionsV1Api(targets.cluster.api_client)
    extensions.create_custom_resource_definition(POD_MONITOR_CRD)
    targets.cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "crd/podmonitors.monitoring.coreos.com"
    )
    try:

        def pod_monitor() -> dict[str, Any] | None:
            try:
                return targets.custom.get_namespaced_custom_object(
                    "monitoring.coreos.com", "v1", targets.namespace, "podmonitors", "watched"
                )
            except kubernetes.client.ApiException as error:
                if error.status == 404:
                    return None
                raise

        monitoring = {"podMonitor": {"enabled": True, "labels": {"release": "prom"}}}
        targets.create(target_manifest("watched", free_port(), monitoring=monitoring))
        monitor = eventually(pod_monitor, "the PodMonitor")
        assert monitor["metadata"]["labels"]["release"] == "prom"
        assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
        # A label removed from the spec is removed from the PodMonitor (server-side apply prunes it).
        targets.patch_spec("watched", {"monitoring": {"podMonitor": {"labels": None}}})
        eventually(lambda: "release" not in pod_monitor()["metadata"]["labels"], "the label pruned")
        # A restarted operator has no memory of the PodMonitor it made, and still deletes it when disabled.
        operator.stop()
        operator.start()
        targets.patch_spec("watched", {"monitoring": {"podMonitor": {"enabled": False}}})
        eventually(lambda: pod_monitor() is None, "the PodMonitor deleted once disabled")
    finally:
        extensions.delete_custom_resource_definition(POD_MONITOR_CRD["metadata"]["name"])


def _shaped(template: kubernetes.client.V1PodTemplateSpec) -> dict[str, Any]:
    """The parts of a pod template the pod settings reach."""
    pod, server = template.spec, template.spec.containers[0]
    shm = next(v for v in pod.volumes if v.name == "dshm")
    return {
        "env": [e.name for e in server.env or []],
        "volumes": [v.name for v in pod.volumes],
        "mounts": [m.mount_path for m in server.volume_mounts],
        "labels": template.metadata.labels,
        "annotations": template.metadata.annotations,
        "runtimeClassName": pod.runtime_class_name,
        "serviceAccountName": pod.service_account_name,
        "schedulerName": pod.scheduler_name,
        "spread": [c.topology_key for c in pod.topology_spread_constraints or []],
        "shm": shm.empty_dir.size_limit,
        "runAsUser": pod.security_context.run_as_user,
    }


def test_pod_settings_reach_the_pod_template_and_leave_with_the_spec(targets: Targets):
    """The RuntimeClass and ServiceAccount exist, so the pods could be admitted as rendered."""
    node = kubernetes.client.NodeV1Api(targets.cluster.api_client)
    node.create_runtime_class({"metadata": {"name": "e3t-test-runtime"}, "handler": "nvidia"})
    try:
        _shape_and_unshape(targets)
    finally:
        node.delete_runtime_class("e3t-test-runtime")


def _shape_and_unshape(targets: Targets) -> None:
    targets.core.create_namespaced_service_account(targets.namespace, {"metadata": {"name": "bucket-reader"}})
    targets.create(target_manifest("shaped", free_port(), **POD_SETTINGS))

    deployment = eventually(lambda: targets.deployment("shaped"), "the Deployment")
    shaped = _shaped(deployment.spec.template)
    assert shaped["env"] == ["HF_HUB_OFFLINE", "HOME", "TMPDIR", "NCCL_DEBUG", "POD"]
    assert shaped["volumes"] == ["model", "dshm", "scratch", "compile-cache"]
    assert "/cache" in shaped["mounts"]
    assert shaped["labels"]["kueue.x-k8s.io/queue-name"] == "gpus"
    assert shaped["labels"]["app.kubernetes.io/instance"] == "shaped"
    assert shaped["annotations"]["team"] == "ml"
    assert (shaped["runtimeClassName"], shaped["serviceAccountName"]) == ("e3t-test-runtime", "bucket-reader")
    assert shaped["schedulerName"] == "gang-scheduler"
    assert shaped["spread"] == ["kubernetes.io/hostname"]
    assert shaped["shm"] == "32Gi"
    assert shaped["runAsUser"] is None
    rolling = deployment.spec.strategy.rolling_update
    assert (rolling.max_surge, rolling.max_unavailable) == (1, 0)

    targets.patch_spec("shaped", dict.fromkeys(POD_SETTINGS))  # a merge patch of nulls deletes the fields

    def plain() -> dict[str, Any] | None:
        template = targets.deployment("shaped").spec.template
        return _shaped(template) if "kueue.x-k8s.io/queue-name" not in template.metadata.labels else None

    shaped = eventually(plain, "the pod settings gone from the template")
    assert shaped["env"] == ["HF_HUB_OFFLINE", "HOME", "TMPDIR"]
    assert shaped["volumes"] == ["model", "dshm", "scratch"]
    assert "/cache" not in shaped["mounts"]
    assert "team" not in shaped["annotations"]
    assert (shaped["runtimeClassName"], shaped["serviceAccountName"]) == (None, None)
    assert shaped["schedulerName"] == "default-scheduler"
    assert shaped["spread"] == []
    assert shaped["shm"] == "16Gi"
    assert shaped["runAsUser"] == 10001
    rolling = targets.deployment("shaped").spec.strategy.rolling_update
    assert (rolling.max_surge, rolling.max_unavailable) == (0, 1)


def test_network_policy_is_accepted_selects_the_targets_pods_and_goes_when_disabled(targets: Targets):
    networking = kubernetes.client.NetworkingV1Api(targets.cluster.api_client)

    def policy() -> kubernetes.client.V1NetworkPolicy | None:
        found = networking.list_namespaced_network_policy(targets.namespace).items
        return found[0] if found else None

    isolation = {"enabled": True, "allowedNamespaces": ["trainers"]}
    targets.create(target_manifest("fenced", free_port(), replicas=2, networkPolicy=isolation))
    targets.create(target_manifest("neighbour", free_port()))
    created = eventually(policy, "the NetworkPolicy")
    assert created.metadata.name == "fenced"
    assert created.metadata.owner_references[0].name == "fenced"
    eventually(lambda: len(targets.pods("fenced")) == 2 and targets.pods("neighbour"), "both targets' pods")
    selector = ",".join(f"{k}={v}" for k, v in created.spec.pod_selector.match_labels.items())
    selected = targets.core.list_namespaced_pod(targets.namespace, label_selector=selector).items
    assert sorted(p.metadata.name for p in selected) == sorted(
        p.metadata.name for p in targets.pods("fenced")
    )
    (data,) = (
        created.spec.ingress
    )  # this operator runs outside the cluster: no namespace of its own, no Prometheus
    assert [port.port for port in data.ports] == ["http"]
    (peer,) = data._from
    assert peer.namespace_selector.match_expressions[0].values == ["trainers"]

    targets.patch_spec("fenced", {"networkPolicy": {"enabled": False}})
    eventually(lambda: policy() is None, "the NetworkPolicy deleted once disabled")
