"""Simulated GPU nodes. kwok manages every Node annotated `kwok.x-k8s.io/node: fake`: it marks it Ready,
renews its lease and gives its scheduled pods IPs from the node's podCIDR, which we keep inside 127.0.0.0/8
so that a server bound on this machine answers at a pod's IP."""

from __future__ import annotations

import os
from typing import Any

import kubernetes

# The second octet of every pod IP (127.POD_NET.x.y). Clusters that run side by side on one machine (several
# checkouts of the repository) set E3T_POD_NET apart so their servers at pod IPs never share an address.
POD_NET = int(os.environ.get("E3T_POD_NET", "1"))
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"
KWOK_ANNOTATION = "kwok.x-k8s.io/node=fake"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
# A GPU node whose pods kwok does not run (kwok-stages.yaml's pod stages skip it by this name): the
# tests' kubelet (support/kubelet.py) runs their server processes and reports their states.
# Tainted, so that only pods which tolerate the taint (and pick the node) land there.
KUBELET_NODE = "gpu-kubelet"
KUBELET_NODE_INDEX = 99
KUBELET_TAINT = {"key": "eagle3.dev/test-kubelet", "value": "true", "effect": "NoSchedule"}


def gpu_node_name(index: int) -> str:
    return f"gpu-{index}"


def gpu_node_pod_cidr(index: int) -> str:
    """Node N hands out 127.1.(N+1).x; kwok's fallback --cidr 127.1.0.0/24 serves nodes without a podCIDR."""
    return f"127.{POD_NET}.{index + 1}.0/24"


def gpu_node(index: int, gpus: int = 8, name: str | None = None) -> dict[str, object]:
    """A Node as a kubelet would register it: the API server keeps the status given at creation, and kwok's
    node-initialize stage keeps capacity and allocatable."""
    name = name or gpu_node_name(index)
    resources = {
        "cpu": "64",
        "memory": "512Gi",
        "pods": "110",
        "ephemeral-storage": "1Ti",
        GPU_RESOURCE: str(gpus),
    }
    key, value = KWOK_ANNOTATION.split("=")
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {key: value},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": GPU_PRODUCT,
                "nvidia.com/gpu.count": str(gpus),
            },
        },
        "spec": {"podCIDR": gpu_node_pod_cidr(index), "podCIDRs": [gpu_node_pod_cidr(index)]},
        "status": {"capacity": resources, "allocatable": resources},
    }


def kubelet_placement() -> dict[str, Any]:
    """The spec fields that put a target's pods (its download's too) on KUBELET_NODE."""
    return {
        "nodeSelector": {"kubernetes.io/hostname": KUBELET_NODE},
        "tolerations": [{"operator": "Equal", **KUBELET_TAINT}],
    }


def kubelet_node() -> dict[str, object]:
    """The node whose pods the tests' kubelet runs (see KUBELET_NODE)."""
    node = gpu_node(KUBELET_NODE_INDEX, name=KUBELET_NODE)
    node["spec"]["taints"] = [KUBELET_TAINT]  # type: ignore[index]
    return node


def create_gpu_nodes(api_client: kubernetes.client.ApiClient, count: int) -> list[str]:
    core = kubernetes.client.CoreV1Api(api_client)
    for index in range(count):
        core.create_node(gpu_node(index))  # type: ignore[arg-type]  # the client sends a dict body as is
    return [gpu_node_name(index) for index in range(count)]


def schedulable(node: kubernetes.client.V1Node) -> bool:
    """Ready, and the node-lifecycle controller has lifted the not-ready taint every new node starts with."""
    conditions = (node.status.conditions if node.status else None) or []
    taints = (node.spec.taints if node.spec else None) or []
    ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
    tainted = any(t.key == NOT_READY_TAINT for t in taints)
    return ready and not tainted


def all_schedulable(api_client: kubernetes.client.ApiClient, names: list[str]) -> bool:
    nodes = kubernetes.client.CoreV1Api(api_client).list_node().items
    by_name = {n.metadata.name: n for n in nodes if n.metadata}
    return all(name in by_name and schedulable(by_name[name]) for name in names)


def gpu_deployment(name: str, replicas: int, gpus: int) -> dict[str, object]:
    """A Deployment whose pods (label app=NAME) each ask `gpus` GPUs; kwok runs them, the image is never
    pulled."""
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [
                        {
                            "name": "main",
                            "image": "example.invalid/none:0",
                            "resources": {"limits": {GPU_RESOURCE: str(gpus)}},
                        }
                    ]
                },
            },
        },
    }


def pod_ready(pod: kubernetes.client.V1Pod) -> bool:
    conditions = (pod.status.conditions if pod.status else None) or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)
