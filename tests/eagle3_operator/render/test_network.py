"""How the server pods are reached: the Service on the data port, the PodMonitor on the metrics port, and
the NetworkPolicy that admits only the named, selected and neighbouring namespaces."""

from typing import Any

from eagle3_operator.render.children import build_children
from eagle3_operator.render.names import owner_reference, selector_labels
from eagle3_operator.render.network import Neighbours, service_url
from eagle3_operator.spec import Eagle3TargetSpec

from support.rendering import (
    UID,
    children,
    make_spec,
    server_of,
)


def test_service_exposes_the_http_port():
    service = children(make_spec(port=9000))["Service"]
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"}
    ]
    assert server_of(make_spec(port=9000))["ports"][0] == {
        "name": "http",
        "containerPort": 9000,
        "protocol": "TCP",
    }
    assert service_url("tiny", "ml", make_spec(port=9000)) == "http://tiny.ml.svc:9000"


def test_pod_monitor_when_enabled_and_its_crd_exists():
    monitoring = {"podMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}}}
    spec = make_spec(monitoring=monitoring)
    monitor = children(spec)["PodMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["selector"] == {"matchLabels": selector_labels("tiny")}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    relabel = {"action": "replace", "targetLabel": "target", "replacement": "tiny"}
    assert endpoint == {"port": "metrics", "path": "/metrics", "interval": "15s", "relabelings": [relabel]}
    assert endpoint["port"] in {p["name"] for p in server_of(spec)["ports"]}
    unsupported = build_children("tiny", "ml", UID, spec, pod_monitor_supported=False)
    assert "PodMonitor" not in {child["kind"] for child in unsupported}
    assert "PodMonitor" not in children(make_spec())


def test_pod_monitor_labels_every_series_with_the_targets_own_name_not_its_child_name():
    """Alerts and dashboards name the target by its resource name, which a child name changes when it has
    dots (not a DNS label) or is over 63 characters."""
    spec = make_spec(monitoring={"podMonitor": {"enabled": True}})
    for name in ("llama-3.1-8b", "x" * 70):
        monitor = children(spec, name=name)["PodMonitor"]
        assert monitor["metadata"]["name"] != name
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        relabel = {"action": "replace", "targetLabel": "target", "replacement": name}
        assert endpoint["relabelings"] == [relabel]


def test_pod_monitor_labels_the_targets_own_over_the_operators_flag_and_the_selecting_ones_over_both():
    """--pod-monitor-label labels every PodMonitor, a target's own labels win on a key, and the labels that
    tie the PodMonitor to its target win over both (the spec and the flag refuse them anyway)."""
    monitoring = {"podMonitor": {"enabled": True, "labels": {"release": "team-prometheus"}}}
    flag_labels = {"release": "kube-prometheus-stack", "team": "ml", "app.kubernetes.io/instance": "other"}
    neighbours = Neighbours(pod_monitor_labels=flag_labels)
    labels = children(make_spec(monitoring=monitoring), neighbours=neighbours)["PodMonitor"]["metadata"][
        "labels"
    ]
    assert labels["release"] == "team-prometheus" and labels["team"] == "ml"
    assert labels["app.kubernetes.io/instance"] == "tiny"
    plain = children(make_spec(monitoring={"podMonitor": {"enabled": True}}), neighbours=neighbours)
    assert plain["PodMonitor"]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert (
        "team"
        not in children(make_spec(monitoring={"podMonitor": {"enabled": True}}))["PodMonitor"]["metadata"][
            "labels"
        ]
    )


def test_neighbours_are_settled_once_made():
    """The operator's flags, made once and shared by every pass: a caller's dict changed later does not
    reach them, and they hash (a frozen value)."""
    labels = {"release": "kube-prometheus-stack"}
    neighbours = Neighbours("eagle3-system", "monitoring", labels)
    labels["release"] = "other"
    assert neighbours.pod_monitor_labels == {"release": "kube-prometheus-stack"}
    assert neighbours in {Neighbours("eagle3-system", "monitoring", {"release": "kube-prometheus-stack"})}


NEIGHBOURS = Neighbours(operator_namespace="eagle3-system", prometheus_namespace="monitoring")


def policy_of(spec: Eagle3TargetSpec, neighbours: Neighbours = NEIGHBOURS) -> dict[str, Any] | None:
    rendered = build_children("tiny", "ml", UID, spec, pod_monitor_supported=True, neighbours=neighbours)
    return next((child for child in rendered if child["kind"] == "NetworkPolicy"), None)


def namespace_names(peer: dict[str, Any]) -> list[str]:
    (expression,) = peer["namespaceSelector"]["matchExpressions"]
    assert (expression["key"], expression["operator"]) == ("kubernetes.io/metadata.name", "In")
    return expression["values"]


def test_network_policy_only_when_enabled():
    assert policy_of(make_spec()) is None
    assert policy_of(make_spec(networkPolicy={"enabled": False, "allowedNamespaces": ["a"]})) is None


def test_network_policy_admits_the_data_port_to_the_named_and_selected_namespaces_only():
    selector = {"matchLabels": {"team": "ml"}}
    spec = make_spec(
        networkPolicy={"enabled": True, "allowedNamespaces": ["trainers"], "namespaceSelector": selector}
    )
    policy = policy_of(spec)
    assert policy["metadata"]["name"] == "tiny"
    assert policy["metadata"]["ownerReferences"] == [owner_reference("tiny", UID)]
    assert policy["spec"]["podSelector"] == {"matchLabels": selector_labels("tiny")}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    data, metrics = policy["spec"]["ingress"]
    assert data["ports"] == [{"protocol": "TCP", "port": "http"}]
    named, selected = data["from"]
    assert namespace_names(named) == ["eagle3-system", "trainers"]
    assert selected == {"namespaceSelector": selector}
    assert metrics["ports"] == [{"protocol": "TCP", "port": "metrics"}]
    (scraper,) = metrics["from"]
    assert namespace_names(scraper) == ["monitoring"]


def test_network_policy_never_renders_a_rule_that_admits_everyone():
    """An ingress rule without peers would admit every source; with nobody to admit there is no rule."""
    policy = policy_of(make_spec(networkPolicy={"enabled": True}), Neighbours())
    assert policy["spec"]["ingress"] == []
    only_operator = policy_of(make_spec(networkPolicy={"enabled": True}), Neighbours("ops"))
    (data,) = only_operator["spec"]["ingress"]
    assert [namespace_names(peer) for peer in data["from"]] == [["ops"]]
