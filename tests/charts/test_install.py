"""The chart installed on the cluster: everything it renders passes a server-side dry run, and the operator,
authenticated only as the chart's ServiceAccount, reconciles a target to Ready."""

from typing import Any

import kubernetes
from eagle3_target.tiny import write_tiny_model

from support.chart import CHART, VALUE_SETS, helm, set_args
from support.cluster.waiting import eventually, free_port
from support.operator_process import OperatorProcess
from support.server_farm import PodServing, ServerFarm


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
