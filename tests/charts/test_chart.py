"""The Helm chart, with the real helm binary: lint, templates for several value sets, values the schema must
refuse, a server-side dry run of everything it renders, an install whose ServiceAccount can do exactly
what the operator needs (checked with `kubectl auth can-i`), and the operator
reconciling a target with that account."""

import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import typer
import yaml
from eagle3_operator import cli
from eagle3_operator.settings import needs_cluster_scanning
from eagle3_target.tiny import write_tiny_model

from support.cluster.waiting import eventually, free_port
from support.operator_process import OperatorProcess
from support.server_farm import PodServing, ServerFarm

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "eagle3-operator"
HELM = ROOT / ".cache" / "bin" / "helm"
CRD_NAME = "eagle3targets.eagle3.dev.yaml"


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """helm without a cluster (lint, template), with its state dirs kept inside .cache."""
    home = ROOT / ".cache" / "helm"
    env = {
        "HELM_CACHE_HOME": f"{home}/cache",
        "HELM_CONFIG_HOME": f"{home}/config",
        "HELM_DATA_HOME": f"{home}/data",
    }
    result = subprocess.run([str(HELM), *args], capture_output=True, text=True, env=env, timeout=60)
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stderr}")
    return result


def set_args(values: dict[str, str]) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def render(values: dict[str, str], namespace: str = "eagle3-system") -> list[dict[str, Any]]:
    out = helm("template", "e3", str(CHART), "--namespace", namespace, *set_args(values)).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = by_kind(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def cli_options(args: list[str]) -> dict[str, Any]:
    """Parse the container's args with the operator's real command line (nothing runs)."""
    command = typer.main.get_command(cli.app)
    return command.make_context("eagle3-operator", list(args)).params


VALUE_SETS = {
    "defaults": {},
    "two namespaces": {"watchNamespaces": "{team-a,team-b}"},
    "service monitor": {
        "metrics.serviceMonitor.enabled": "true",
        "metrics.serviceMonitor.labels.release": "prom",
    },
    "own account and ports": {
        "serviceAccount.create": "false",
        "serviceAccount.name": "existing-operator",
        "healthPort": "9000",
        "metrics.port": "9001",
        "logLevel": "debug",
        "image.tag": "dev",
    },
    "no metrics service": {"metrics.service.enabled": "false"},
    "prometheus namespace, no user roles": {
        "targets.prometheusNamespace": "monitoring",
        "rbac.aggregateToDefaultRoles": "false",
    },
}


def test_chart_crds_are_the_source_crds():
    source = ROOT / "crds" / CRD_NAME
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == [CRD_NAME]
    assert (CHART / "crds" / CRD_NAME).read_bytes() == source.read_bytes()


@pytest.mark.parametrize("case", sorted(VALUE_SETS))
def test_lint_strict(case):
    result = helm("lint", "--strict", str(CHART), *set_args(VALUE_SETS[case]))
    assert "0 chart(s) failed" in result.stdout


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


def test_server_image_value_reaches_the_operator():
    options = cli_options(operator_container(render({"serverImage": "mirror.local/e3t:0.1.0"}))["args"])
    assert options["server_image"] == "mirror.local/e3t:0.1.0"


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
    assert options["prometheus_namespace"] == (values.get("targets.prometheusNamespace") or None)
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
    dockerfile = (ROOT / "image" / "operator.Dockerfile").read_text()
    (deployment,) = by_kind(render({}), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (user,) = re.findall(r"^USER (\d+):(\d+)$", dockerfile, flags=re.MULTILINE)
    assert user == (str(pod["securityContext"]["runAsUser"]), str(pod["securityContext"]["runAsGroup"]))
    (exposed,) = re.findall(r"^EXPOSE (.+)$", dockerfile, flags=re.MULTILINE)
    assert sorted(exposed.split()) == sorted(
        str(p["containerPort"]) for p in operator_container(render({}))["ports"]
    )
    bases = re.findall(r"^FROM (\S+)", dockerfile, flags=re.MULTILINE)
    assert bases and all(re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+", base) for base in bases)
    assert '".[operator]"' in dockerfile


def test_watch_namespaces_gives_roles_there_and_only_the_crd_cluster_wide():
    objects = render(VALUE_SETS["two namespaces"] | {"leaderElection.enabled": "false"})
    roles = by_kind(objects, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in by_kind(objects, "RoleBinding")) == ["team-a", "team-b"]
    # Exact names turn kopf's Namespace and CRD watches off: the operator's one cluster-scoped grant is
    # reading the Eagle3Target CRD (its schema version is checked at startup); the other ClusterRoles are
    # the users' aggregated ones, which the chart binds to no one.
    (binding,) = by_kind(objects, "ClusterRoleBinding")
    roles = {role["metadata"]["name"]: role for role in by_kind(objects, "ClusterRole")}
    assert roles.pop(binding["roleRef"]["name"])["rules"] == [
        {
            "apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"],
            "resourceNames": ["eagle3targets.eagle3.dev"],
            "verbs": ["get"],
        }
    ]
    for role in roles.values():
        assert role["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    options = cli_options(operator_container(objects)["args"])
    assert options["namespace"] == ["team-a", "team-b"] and options["all_namespaces"] is False
    assert not needs_cluster_scanning(options["namespace"])


def test_rules_name_no_wildcards_and_no_secrets():
    for values in VALUE_SETS.values():
        objects = render(values)
        rules = [
            rule
            for role in by_kind(objects, "ClusterRole") + by_kind(objects, "Role")
            for rule in role["rules"]
        ]
        for rule in rules:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
        # The operator probes without tokens, so it may not even read a Secret (no confused deputy).
        assert rules and not [rule for rule in rules if "secrets" in rule["resources"]]


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


def user_roles(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The aggregated ClusterRoles for namespace users, by the built-in role they extend."""
    aggregated = [
        role
        for role in by_kind(objects, "ClusterRole")
        if any(
            key.startswith("rbac.authorization.k8s.io/aggregate-to-") for key in role["metadata"]["labels"]
        )
    ]
    return {role["metadata"]["name"].rsplit("-", 1)[1]: role for role in aggregated}


def test_user_roles_extend_the_built_in_view_edit_and_admin_roles():
    roles = user_roles(render({}))
    assert sorted(roles) == ["edit", "view"]
    view_labels, edit_labels = roles["view"]["metadata"]["labels"], roles["edit"]["metadata"]["labels"]
    for role in ("view", "edit", "admin"):
        assert view_labels[f"rbac.authorization.k8s.io/aggregate-to-{role}"] == "true"
    assert "rbac.authorization.k8s.io/aggregate-to-view" not in edit_labels  # viewers never write
    (view_rule,) = roles["view"]["rules"]
    assert view_rule["verbs"] == ["get", "list", "watch"]
    # Status is the operator's report: no user role writes it.
    assert all("eagle3targets/status" not in rule["resources"] for rule in roles["edit"]["rules"])
    assert user_roles(render(VALUE_SETS["prometheus namespace, no user roles"])) == {}


BAD_VALUES = {
    "namespaces as a string": ({"watchNamespaces": "all"}, "at '/watchNamespaces': got string, want array"),
    "bad namespace name": ({"watchNamespaces": "{Team_A}"}, "'Team_A' does not match pattern"),
    "privileged port": ({"healthPort": "80"}, "at '/healthPort': minimum"),
    "same two ports": ({"metrics.port": "8080"}, "healthPort and metrics.port must differ"),
    "pull policy": (
        {"image.pullPolicy": "Sometimes"},
        "value must be one of 'Always', 'IfNotPresent', 'Never'",
    ),
    "unknown key": ({"replica": "2"}, "additional properties 'replica' not allowed"),
    "two replicas without election": (
        {"replicas": "2", "leaderElection.enabled": "false"},
        "at '/leaderElection/enabled': value must be true",
    ),
    "monitor without service": (
        {"metrics.serviceMonitor.enabled": "true", "metrics.service.enabled": "false"},
        "at '/metrics/service/enabled': value must be true",
    ),
    "no account": ({"serviceAccount.create": "false"}, "at '/serviceAccount/name'"),
    "bad quantity": ({"resources.limits.memory": "lots"}, "at '/resources/limits/memory'"),
    "log level": ({"logLevel": "trace"}, "at '/logLevel'"),
    "bad prometheus namespace": (
        {"targets.prometheusNamespace": "Mon_1"},
        "at '/targets/prometheusNamespace'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_values_are_refused(case):
    values, expected = BAD_VALUES[case]
    result = helm("template", "e3", str(CHART), *set_args(values), check=False)
    assert result.returncode != 0
    assert expected in result.stderr


def test_every_rendered_object_passes_a_server_side_dry_run(cluster, namespace):
    """Both RBAC modes (the Roles go to real namespaces) and the CRD itself; the ServiceMonitor set is left
    out because this cluster has no prometheus-operator CRDs."""
    for values in ({}, {"watchNamespaces": f"{{{namespace}}}"}, VALUE_SETS["own account and ports"]):
        manifest = helm(
            "template", "e3", str(CHART), "--namespace", namespace, "--include-crds", *set_args(values)
        ).stdout
        result = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=manifest)
        kinds = {line.split("/")[0] for line in result.stdout.splitlines()}
        assert "deployment.apps" in kinds
        assert "customresourcedefinition.apiextensions.k8s.io" in kinds


def can_i(cluster, account: str, verb: str, resource: str, namespace: str, *extra: str) -> bool:
    result = cluster.kubectl(
        "auth", "can-i", verb, resource, f"--as={account}", "-n", namespace, *extra, check=False
    )
    return result.stdout.strip() == "yes"


def may_apply_pod_monitors(cluster, account: str, namespace: str) -> bool:
    """kubectl cannot name a resource this cluster does not serve (no prometheus-operator CRDs here), so ask
    the authorizer directly with a SubjectAccessReview."""
    _, _, account_namespace, _ = account.split(":")
    groups = ["system:serviceaccounts", f"system:serviceaccounts:{account_namespace}", "system:authenticated"]
    attributes = {"group": "monitoring.coreos.com", "resource": "podmonitors", "namespace": namespace}
    allowed = []
    for verb in ("create", "patch", "delete"):
        review = kubernetes.client.V1SubjectAccessReview(
            spec=kubernetes.client.V1SubjectAccessReviewSpec(
                user=account, groups=groups, resource_attributes={**attributes, "verb": verb}
            )
        )
        answer = kubernetes.client.AuthorizationV1Api(cluster.api_client).create_subject_access_review(review)
        allowed.append(answer.status.allowed)
    return all(allowed)


NEEDED = [
    ("list", "eagle3targets.eagle3.dev"),
    ("watch", "eagle3targets.eagle3.dev"),
    ("patch", "eagle3targets.eagle3.dev", "--subresource=status"),
    ("create", "deployments.apps"),
    ("patch", "deployments.apps"),
    ("get", "deployments.apps"),
    ("get", "services"),
    ("delete", "deployments.apps"),
    ("watch", "deployments.apps"),
    ("patch", "services"),
    ("patch", "poddisruptionbudgets.policy"),
    ("watch", "networkpolicies.networking.k8s.io"),
    ("patch", "networkpolicies.networking.k8s.io"),
    ("delete", "networkpolicies.networking.k8s.io"),
    ("watch", "jobs.batch"),
    ("create", "jobs.batch"),
    ("delete", "jobs.batch"),
    ("watch", "pods"),
    ("create", "events"),
    ("update", "eagle3targets.eagle3.dev", "--subresource=finalizers"),
]
FORBIDDEN = [
    ("get", "secrets"),
    ("watch", "secrets"),
    ("create", "secrets"),
    ("update", "secrets"),
    ("delete", "secrets"),
    ("list", "secrets"),
    ("patch", "eagle3targets.eagle3.dev"),
    ("delete", "eagle3targets.eagle3.dev"),
    ("get", "pods"),
    ("create", "pods"),
    ("delete", "pods"),
    ("create", "pods", "--subresource=exec"),
    ("create", "roles.rbac.authorization.k8s.io"),
    ("create", "serviceaccounts", "--subresource=token"),
    ("update", "networkpolicies.networking.k8s.io"),
    ("update", "jobs.batch"),
    ("create", "cronjobs.batch"),
    ("*", "*"),
]


def test_installed_service_account_has_exactly_what_the_operator_needs(cluster, namespace):
    watched = f"{namespace}-w"
    cluster.kubectl("create", "namespace", watched)
    try:
        cluster.helm(
            "install", "e3", str(CHART), "--namespace", namespace, "--wait", "--timeout=90s",
            "--set", f"watchNamespaces={{{watched}}}",
        )  # fmt: skip
        account = f"system:serviceaccount:{namespace}:e3-eagle3-operator"
        for check in NEEDED:
            assert can_i(cluster, account, *check[:2], watched, *check[2:]), check
        assert may_apply_pod_monitors(cluster, account, watched)
        for check in FORBIDDEN:
            assert not can_i(cluster, account, *check[:2], watched, *check[2:]), check
        # Outside the watched namespace it can do nothing of the above, not even read targets.
        for check in NEEDED:
            assert not can_i(cluster, account, *check[:2], "default", *check[2:]), check
        assert not may_apply_pod_monitors(cluster, account, "default")
        # Cluster-wide only the Eagle3Target CRD may be read: no Namespace or CRD lists or watches.
        for verb in ("list", "watch", "create"):
            for resource in ("customresourcedefinitions.apiextensions.k8s.io", "namespaces"):
                assert not can_i(cluster, account, verb, resource, "default"), (verb, resource)
        crd = "customresourcedefinitions.apiextensions.k8s.io/eagle3targets.eagle3.dev"
        assert can_i(cluster, account, "get", crd, "default")
        assert not can_i(
            cluster, account, "get", "customresourcedefinitions.apiextensions.k8s.io/other.x", "default"
        )
        # Its Lease, in its own namespace only.
        assert can_i(cluster, account, "update", "leases.coordination.k8s.io/e3-eagle3-operator", namespace)
        assert not can_i(cluster, account, "update", "leases.coordination.k8s.io/other", namespace)
        assert not can_i(cluster, account, "create", "leases.coordination.k8s.io", watched)
        status = cluster.kubectl(
            "get", "deployment", "e3-eagle3-operator", "-n", namespace, "-o", "yaml"
        ).stdout
        assert yaml.safe_load(status)["status"]["availableReplicas"] == 1
    finally:
        cluster.helm("uninstall", "e3", "--namespace", namespace, check=False)
        cluster.kubectl("delete", "namespace", watched, "--wait=false", check=False)


def test_cluster_wide_install_reaches_every_namespace(cluster, namespace):
    release = f"e3-{namespace[-6:]}"
    try:
        cluster.helm("install", release, str(CHART), "--namespace", namespace)
        account = f"system:serviceaccount:{namespace}:{release}-eagle3-operator"
        for target_namespace in (namespace, "default"):
            for check in NEEDED:
                assert can_i(cluster, account, *check[:2], target_namespace, *check[2:]), check
            assert may_apply_pod_monitors(cluster, account, target_namespace)
            for check in FORBIDDEN:
                assert not can_i(cluster, account, *check[:2], target_namespace, *check[2:]), check
        # Cluster-wide the operator needs no CRD watch (kopf's scanning is off): it reads its own CRD only.
        for verb in ("list", "watch", "create"):
            assert not can_i(
                cluster, account, verb, "customresourcedefinitions.apiextensions.k8s.io", "default"
            )
    finally:
        cluster.helm("uninstall", release, "--namespace", namespace, check=False)


def test_operator_with_the_charts_account_reconciles_a_target_to_ready(cluster, namespace, tmp_path):
    """The RBAC is sufficient: the operator, authenticated only as the chart's ServiceAccount (as its pod
    would be), takes a target to Ready against a real server at the kwok pod's IP."""
    watched = f"{namespace}-w"
    cluster.kubectl("create", "namespace", watched)
    cluster.helm(
        "install", "e3", str(CHART), "--namespace", namespace, "--set", f"watchNamespaces={{{watched}}}"
    )
    farm = ServerFarm(write_tiny_model(tmp_path / "model", arch="llama"))
    core = kubernetes.client.CoreV1Api(cluster.api_client)
    serving = PodServing(core, watched, farm)
    kubeconfig = cluster.write_service_account_kubeconfig(namespace, "e3-eagle3-operator", tmp_path / "sa")
    operator = OperatorProcess(kubeconfig, tmp_path, [watched])
    try:
        operator.start()
        port = free_port()
        serving.ports.add(port)
        target = {
            "apiVersion": "eagle3.dev/v1alpha1",
            "kind": "Eagle3Target",
            "metadata": {"name": "charted"},
            "spec": {
                "model": {"name": "tiny-llama", "source": {"hostPath": {"path": "/models/tiny"}}},
                "engine": "hf",
                "port": port,
            },
        }
        custom = kubernetes.client.CustomObjectsApi(cluster.api_client)
        custom.create_namespaced_custom_object("eagle3.dev", "v1alpha1", watched, "eagle3targets", target)

        def ready() -> dict[str, Any] | None:
            body = custom.get_namespaced_custom_object(
                "eagle3.dev", "v1alpha1", watched, "eagle3targets", "charted"
            )
            status = body.get("status") or {}
            conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
            return status if conditions.get("Ready") == "True" else None

        status = eventually(ready, "the target Ready under the chart's ServiceAccount", timeout=120)
        assert status["endpoints"][0]["ready"] and status["model"]["name"] == "tiny-llama"
        log = operator.log()
        assert "Forbidden" not in log and "403" not in log and "Not enough permissions" not in log
    finally:
        operator.stop()
        serving.close()
        farm.close()
        cluster.helm("uninstall", "e3", "--namespace", namespace, check=False)
        cluster.kubectl("delete", "namespace", watched, "--wait=false", check=False)


def test_namespace_users_manage_targets_through_the_default_roles(cluster, namespace):
    """A user bound to the built-in edit role in one namespace may create and scale targets there (and
    nowhere else) but not write their status; a view user may only read them."""
    release = f"e3-{namespace[-6:]}"
    try:
        cluster.helm("install", release, str(CHART), "--namespace", namespace)
        for user, role in (("ada", "edit"), ("vic", "view")):
            cluster.kubectl(
                "create",
                "rolebinding",
                f"{user}-{role}",
                f"--clusterrole={role}",
                f"--user={user}",
                "-n",
                namespace,
            )
        targets = "eagle3targets.eagle3.dev"

        def settled() -> bool:  # the aggregation controller fills the built-in roles asynchronously
            return can_i(cluster, "ada", "create", targets, namespace) and can_i(
                cluster, "vic", "get", targets, namespace
            )

        eventually(settled, "the built-in roles to aggregate the chart's", timeout=30)
        for verb in ("create", "patch", "delete", "list", "watch"):
            assert can_i(cluster, "ada", verb, targets, namespace), verb
        assert can_i(cluster, "ada", "update", targets, namespace, "--subresource=scale")
        assert not can_i(cluster, "ada", "patch", targets, namespace, "--subresource=status")
        assert not can_i(cluster, "ada", "create", targets, "default")
        for verb in ("get", "list", "watch"):
            assert can_i(cluster, "vic", verb, targets, namespace), verb
        for verb in ("create", "patch", "delete"):
            assert not can_i(cluster, "vic", verb, targets, namespace), verb
    finally:
        cluster.helm("uninstall", release, "--namespace", namespace, check=False)
