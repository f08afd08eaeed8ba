"""How the server pods are reached: the Service in front of the data port, the URL status publishes, the
PodMonitor on the metrics port, and the NetworkPolicy that admits exactly those who need either port."""

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from eagle3_operator.constants import POD_MONITOR_API_VERSION
from eagle3_operator.render.names import child_metadata, child_name, selector_labels
from eagle3_operator.spec import Eagle3TargetSpec

# The server container's port names; the Service, PodMonitor and NetworkPolicy refer to the ports by them.
PORT_NAME = "http"
METRICS_PORT_NAME = "metrics"
# The label the API server puts on every Namespace: NetworkPolicies select namespaces by name with it.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


@dataclass(frozen=True)
class Neighbours:
    """What the cluster around a target asks of its children, beyond its spec (the operator's flags): the
    namespaces its NetworkPolicy admits, the operator's (it probes the servers' data port) and Prometheus'
    (it scrapes the metrics port; None: not known, not admitted), and the labels that Prometheus selects
    PodMonitors by (--pod-monitor-label)."""

    operator_namespace: str | None = None
    prometheus_namespace: str | None = None
    # Kept read-only; left out of the hash (a mapping has none), so equal settings still hash alike.
    pod_monitor_labels: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pod_monitor_labels", MappingProxyType(dict(self.pod_monitor_labels)))


def service_url(name: str, namespace: str, spec: Eagle3TargetSpec) -> str:
    """The stable URL published in status: the external endpoint, or the Service's cluster DNS name."""
    if spec.endpoint is not None:
        return spec.endpoint.url.rstrip("/")
    return f"http://{child_name(name)}.{namespace}.svc:{spec.port}"


def build_service(name: str, namespace: str, spec: Eagle3TargetSpec, owner: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(child_name(name), name, namespace, owner),
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


def build_pod_monitor(
    name: str, namespace: str, spec: Eagle3TargetSpec, owner: dict[str, Any], neighbours: Neighbours
) -> dict[str, Any] | None:
    """A prometheus-operator PodMonitor on the server's metrics port (no token needed), when asked for;
    labelled for the Prometheus that should select it (the target's own labels win over the operator's).
    Every series it scrapes carries a `target` label with the resource's own name (the child name differs
    for names with dots or over 63 characters), so alerts and dashboards name the target as the operator's
    own metrics do."""
    monitor = spec.monitoring.pod_monitor
    if not monitor.enabled:
        return None
    metadata = child_metadata(child_name(name), name, namespace, owner)
    metadata["labels"] = {**neighbours.pod_monitor_labels, **monitor.labels, **metadata["labels"]}
    return {
        "apiVersion": POD_MONITOR_API_VERSION,
        "kind": "PodMonitor",
        "metadata": metadata,
        "spec": {
            "selector": {"matchLabels": selector_labels(name)},
            "podMetricsEndpoints": [
                {
                    "port": METRICS_PORT_NAME,
                    "path": "/metrics",
                    "interval": monitor.interval,
                    "relabelings": [{"action": "replace", "targetLabel": "target", "replacement": name}],
                }
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
        "metadata": child_metadata(child_name(name), name, namespace, owner),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(name)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
