"""The full set of a target's children: what a default target owns, nothing for an external one, no shared
mutable parts, and a server-side dry run of every rendered object against the real API server."""

import json

import kubernetes
from eagle3_operator.render.children import build_children
from eagle3_operator.render.names import owner_reference
from eagle3_operator.render.network import Neighbours, service_url
from eagle3_operator.spec import Eagle3TargetSpec

from support.rendering import (
    HF_SOURCE,
    LONG_NAME,
    UID,
    children,
    make_spec,
)
from support.targets import POD_SETTINGS


def test_default_target_renders_deployment_and_service():
    rendered = children(make_spec())
    assert sorted(rendered) == ["Deployment", "Service"]
    for child in rendered.values():
        meta = child["metadata"]
        assert meta["name"] == "tiny" and meta["namespace"] == "ml"
        assert meta["ownerReferences"] == [owner_reference("tiny", UID)]
        assert meta["ownerReferences"][0]["controller"] is True
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "eagle3-operator"
    json.dumps(list(rendered.values()))  # server-side apply sends JSON


def test_external_target_has_no_children():
    spec = Eagle3TargetSpec.parse({"endpoint": {"url": "https://target.example:8443/"}})
    assert build_children("ext", "ml", UID, spec, pod_monitor_supported=True) == []
    assert service_url("ext", "ml", spec) == "https://target.example:8443"


def test_children_do_not_share_mutable_parts():
    rendered = build_children("tiny", "ml", UID, make_spec(replicas=2), pod_monitor_supported=True)
    rendered[0]["metadata"]["ownerReferences"][0]["name"] = "changed"
    assert all(child["metadata"]["ownerReferences"][0]["name"] == "tiny" for child in rendered[1:])


def test_rendered_children_pass_a_server_side_dry_run(cluster, namespace):
    """The API server's own validation accepts every rendered object (the PodMonitor needs its CRD, which this
    cluster does not have, so it is left out)."""
    spec = make_spec(
        HF_SOURCE,
        replicas=2,
        tensorParallelSize=2,
        auxLayerIds=[1, 2, 3],
        maxModelLen=2048,
        engineArgs={"gpu-memory-utilization": "0.9"},
        resources={"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        auth={"tokenSecretRef": {"name": "token"}},
        affinity={"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
        **POD_SETTINGS,
        networkPolicy={
            "enabled": True,
            "allowedNamespaces": ["trainers"],
            "namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In", "values": ["ml"]}]},
        },
    )
    client = kubernetes.dynamic.DynamicClient(cluster.api_client)
    neighbours = Neighbours(operator_namespace="eagle3-system", prometheus_namespace="monitoring")
    rendered = build_children(
        LONG_NAME, namespace, UID, spec, pod_monitor_supported=False, neighbours=neighbours
    )
    kinds = {child["kind"] for child in rendered}
    assert kinds == {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "Job"}
    for child in rendered:
        api = client.resources.get(api_version=child["apiVersion"], kind=child["kind"])
        created = api.create(body=child, namespace=namespace, dry_run="All")
        assert created.metadata.name == child["metadata"]["name"]
