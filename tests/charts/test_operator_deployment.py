"""The operator's Deployment as the chart renders it for each value set: replicas and leader election, the
operator's args (parsed by its real command line), probes and ports, a locked-down container matching its
image, the metrics ServiceMonitor and the ServiceAccount it runs as."""

import re

import pytest
from eagle3_operator.constants import MANAGED_LABELS

from support.chart import VALUE_SETS, by_kind, cli_options, operator_container, render
from support.cluster.access import REPO


def test_defaults_serve_every_namespace_with_one_elected_replica():
    objects = render({})
    assert sorted(o["kind"] for o in objects) == [
        "ClusterRole",
        "ClusterRole",
        "ClusterRole",
        "ClusterRole",
        "ClusterRoleBinding",
        "ClusterRoleBinding",
        "Deployment",
        "NetworkPolicy",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
    ]
    (deployment,) = by_kind(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    # The new pod of an upgrade waits as standby until the old one releases the Lease.
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    options = cli_options(operator_container(objects)["args"])
    assert options["all_namespaces"] is True and not options["namespace"]
    assert options["leader_elect"] is True and options["leader_election_namespace"] == "eagle3-system"
    (role,) = by_kind(objects, "Role")
    assert role["metadata"]["namespace"] == "eagle3-system"
    assert {r["resources"][0] for r in role["rules"]} == {"leases"}
    assert [r.get("resourceNames") for r in role["rules"] if "update" in r["verbs"]] == [
        [options["leader_election_name"]]
    ]


def test_two_replicas_need_leader_election_and_without_it_one_is_recreated():
    objects = render({"replicas": "2"})
    (deployment,) = by_kind(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert cli_options(operator_container(objects)["args"])["leader_elect"] is True
    single = render({"leaderElection.enabled": "false"})
    (deployment,) = by_kind(single, "Deployment")
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert cli_options(operator_container(single)["args"])["leader_elect"] is False
    assert not by_kind(single, "Role")


def test_server_image_values_reach_the_operator():
    values = {"serverImage": "mirror.local/e3t:0.1.0", "sglangServerImage": "mirror.local/e3t:0.1.0-sglang"}
    options = cli_options(operator_container(render(values))["args"])
    assert options["server_image"] == "mirror.local/e3t:0.1.0"
    assert options["sglang_server_image"] == "mirror.local/e3t:0.1.0-sglang"


@pytest.mark.parametrize("case", sorted(VALUE_SETS))
def test_operator_args_are_valid_and_probes_hit_its_ports(case):
    values = VALUE_SETS[case]
    container = operator_container(render(values))
    options = cli_options(container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert options["liveness"] == f"http://0.0.0.0:{ports['health']}/healthz"
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert options["metrics_port"] == ports["metrics"]
    assert options["verbose"] is (values.get("logLevel") == "debug")
    assert options["prometheus_namespace"] == values.get("targets.prometheusNamespace", "monitoring")
    (pod_namespace,) = [e for e in container["env"] if e["name"] == "POD_NAMESPACE"]
    assert pod_namespace["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert container["image"] == f"ghcr.io/eagle3-dev/eagle3-operator:{values.get('image.tag', '0.1.0')}"


def test_operator_container_is_locked_down():
    objects = render({})
    (deployment,) = by_kind(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    context = operator_container(objects)["securityContext"]
    assert context["allowPrivilegeEscalation"] is False and context["readOnlyRootFilesystem"] is True
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert operator_container(objects)["resources"]["limits"]["memory"] == "512Mi"


def test_operator_image_matches_the_chart():
    """image/operator.Dockerfile runs the user the chart's pod expects and exposes the default ports."""
    dockerfile = (REPO / "image" / "operator.Dockerfile").read_text()
    (deployment,) = by_kind(render({}), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (user,) = re.findall(r"^USER (\d+):(\d+)$", dockerfile, flags=re.MULTILINE)
    assert user == (str(pod["securityContext"]["runAsUser"]), str(pod["securityContext"]["runAsGroup"]))
    (exposed,) = re.findall(r"^EXPOSE (.+)$", dockerfile, flags=re.MULTILINE)
    assert sorted(exposed.split()) == sorted(
        str(p["containerPort"]) for p in operator_container(render({}))["ports"]
    )
    bases = re.findall(r"^FROM (\S+)", dockerfile, flags=re.MULTILINE)
    assert bases and set(bases) == {"${BASE}"}
    (default,) = re.findall(r"^ARG BASE=(\S+)$", dockerfile, flags=re.MULTILINE)
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+", default)
    # The operator extra's lock, exactly (a sync), hashes checked; then the project without its dependencies.
    assert "uv pip sync --python /opt/venv/bin/python --require-hashes locks/operator.txt" in dockerfile
    assert "uv pip install --python /opt/venv/bin/python --no-deps ." in dockerfile


def test_service_monitor_scrapes_the_metrics_service():
    objects = render(VALUE_SETS["service monitor"])
    (monitor,) = by_kind(objects, "ServiceMonitor")
    (service,) = by_kind(objects, "Service")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"] == "metrics"
    assert not by_kind(render({}), "ServiceMonitor")


def test_existing_service_account_is_used_not_created():
    objects = render(VALUE_SETS["own account and ports"])
    assert not by_kind(objects, "ServiceAccount")
    (deployment,) = by_kind(objects, "Deployment")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "existing-operator"
    bindings = by_kind(objects, "ClusterRoleBinding")
    assert bindings
    for binding in bindings:
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "existing-operator", "namespace": "eagle3-system"}
        ]


def test_readiness_probe_asks_the_operators_readiness_endpoint():
    container = operator_container(render({"readinessPort": "9100"}))
    probe = container["readinessProbe"]["httpGet"]
    (port,) = [p for p in container["ports"] if p["name"] == probe["port"]]
    assert port["containerPort"] == 9100
    assert cli_options(container["args"])["readiness"] == f"http://0.0.0.0:9100{probe['path']}"


def test_network_policy_lets_the_operator_reach_only_the_api_server_and_its_pods():
    (policy,) = by_kind(render({}), "NetworkPolicy")
    (deployment,) = by_kind(render({}), "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    assert spec["ingress"] == [{"ports": [{"port": "metrics", "protocol": "TCP"}]}]
    api_server, managed = spec["egress"]
    assert [p["port"] for p in api_server["ports"]] == [443, 6443] and "to" not in api_server
    (peer,) = managed["to"]
    assert peer["podSelector"]["matchLabels"] == dict(MANAGED_LABELS)
    assert peer["namespaceSelector"] == {}  # every namespace, as the operator serves them all

    narrowed = render(
        {"watchNamespaces": "{team-a,team-b}", "networkPolicy.apiServer.cidrs": "{10.0.0.1/32}"}
    )
    (policy,) = by_kind(narrowed, "NetworkPolicy")
    api_server, managed = policy["spec"]["egress"]
    assert api_server["to"] == [{"ipBlock": {"cidr": "10.0.0.1/32"}}]
    (expression,) = managed["to"][0]["namespaceSelector"]["matchExpressions"]
    assert expression["values"] == ["team-a", "team-b"]
    assert not by_kind(render({"networkPolicy.enabled": "false"}), "NetworkPolicy")
