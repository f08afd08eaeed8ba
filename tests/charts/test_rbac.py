"""The chart's RBAC: what it renders (namespaced Roles where it watches, no wildcards, no Secrets, the users'
aggregated roles), and, installed on the cluster, what its ServiceAccount and the namespace users may do
(`kubectl auth can-i` and SubjectAccessReviews): exactly what the operator needs, nothing more."""

from typing import Any

import kubernetes
import yaml
from eagle3_operator.settings import needs_cluster_scanning

from support.chart import CHART, VALUE_SETS, by_kind, cli_options, operator_container, render
from support.cluster.waiting import eventually


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
    assert user_roles(render(VALUE_SETS["other prometheus, no user roles"])) == {}


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
