"""The chart installed on the cluster: everything it renders passes a server-side dry run, and the operator,
authenticated only as the chart's ServiceAccount, reconciles a target to Ready."""

from support.chart import CHART, VALUE_SETS, helm, set_args
from support.cluster.waiting import eventually, free_port
from support.operator_process import OperatorProcess
from support.server_farm import PodServing
from support.targets import Targets, target_manifest


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


def test_operator_with_the_charts_account_reconciles_a_target_to_ready(cluster, namespace, servers, tmp_path):
    """The RBAC is sufficient: the operator, authenticated only as the chart's ServiceAccount (as its pod
    would be), takes a target to Ready against a real server at the kwok pod's IP."""
    watched = f"{namespace}-w"
    cluster.kubectl("create", "namespace", watched)
    cluster.helm(
        "install", "e3", str(CHART), "--namespace", namespace, "--set", f"watchNamespaces={{{watched}}}"
    )
    targets = Targets(cluster, watched)
    serving = PodServing(targets.core, watched, servers)
    kubeconfig = cluster.write_service_account_kubeconfig(namespace, "e3-eagle3-operator", tmp_path / "sa")
    operator = OperatorProcess(kubeconfig, tmp_path, [watched])
    try:
        operator.start()
        port = free_port()
        serving.ports.add(port)
        targets.create(target_manifest("charted", port))
        status = eventually(
            lambda: targets.ready_status("charted"), "the target Ready under the chart's ServiceAccount", 120
        )
        assert status["endpoints"][0]["ready"] and status["model"]["name"] == "tiny-llama"
        log = operator.log()
        assert "Forbidden" not in log and "403" not in log and "Not enough permissions" not in log
    finally:
        operator.stop()
        serving.close()
        cluster.helm("uninstall", "e3", "--namespace", namespace, check=False)
        cluster.kubectl("delete", "namespace", watched, "--wait=false", check=False)
