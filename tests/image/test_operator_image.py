"""The operator image, built by image/build.sh (cached by its inputs) and run with `buildah run` the way
the chart's pod runs it: its own numeric user, a read-only root with /tmp writable. Against the local
control plane it reconciles a target and answers its liveness and readiness probes."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import kubernetes
import pytest

from support.chart import by_kind, render
from support.cluster.access import Cluster
from support.cluster.waiting import eventually
from support.containers import ContainerOperator, ReadOnlyContainer, build_image, buildah
from support.targets import Targets, target_manifest

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def operator_image() -> str:
    image, output = build_image("operator")
    print(output)
    return image


def chart_operator_pod() -> dict:
    (deployment,) = by_kind(render({}), "Deployment")
    return deployment["spec"]["template"]["spec"]


def test_the_image_runs_as_the_charts_user_with_a_read_only_root(operator_image):
    pod = chart_operator_pod()
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    writable = [mount["mountPath"] for mount in container["volumeMounts"]]
    with ReadOnlyContainer(operator_image, writable=writable) as ctr:
        probe = "id -u; id -g; touch /etc/x 2>/dev/null || echo read-only; touch /tmp/x && echo tmp-writable"
        result = subprocess.run(ctr.run_argv(["sh", "-c", probe]), capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == [
        str(pod["securityContext"]["runAsUser"]),
        str(pod["securityContext"]["runAsGroup"]),
        "read-only",
        "tmp-writable",
    ], result.stderr


def test_the_image_records_its_revision(operator_image):
    labels = json.loads(buildah("inspect", "--type=image", operator_image))["OCIv1"]["config"]["Labels"]
    assert re.fullmatch(r"[0-9a-f]{12}(-dirty)?", labels["org.opencontainers.image.revision"]), labels


def test_the_image_reconciles_a_target_and_answers_its_probes(
    operator_image, cluster: Cluster, crd: None, namespace: str, tmp_path: Path
):
    writable = [m["mountPath"] for m in chart_operator_pod()["containers"][0]["volumeMounts"]]
    config_dir = tmp_path / "kube"
    config_dir.mkdir()
    kubeconfig = config_dir / "config"
    # Certificates inline: the files the plane's kubeconfig names are not inside the container.
    kubeconfig.write_text(cluster.kubectl("config", "view", "--raw", "--flatten").stdout)
    with ReadOnlyContainer(operator_image, writable=writable, binds={config_dir: "/kube"}) as ctr:
        operator = ContainerOperator(ctr, kubeconfig, tmp_path, [namespace], name="image-operator")
        try:
            operator.start()  # returns once the liveness endpoint answers 200
            eventually(lambda: operator.readiness()[0] == 200, "the operator ready")
            assert operator.readiness()[1] == {"ready": True, "standby": False, "leading": True}
            uid = _uid_of(f"--readiness=http://127.0.0.1:{operator.readiness_port}/")
            assert uid == chart_operator_pod()["securityContext"]["runAsUser"]

            targets = Targets(cluster, namespace)
            targets.create(target_manifest("boxed", 18000))
            eventually(lambda: targets.deployment("boxed") is not None, "the target's Deployment")

            def observed() -> bool:
                status = targets.status("boxed")
                return status.get("observedGeneration") == 1 and bool(status.get("conditions"))

            eventually(observed, "the target's status written by the operator in the image", timeout=60)
            core = kubernetes.client.CoreV1Api(cluster.api_client)
            assert core.list_namespaced_pod(namespace).items, "the Deployment's pod"
        finally:
            operator.stop()
        assert "Traceback" not in operator.log(), operator.log()[-3000:]


def _uid_of(argument: str) -> int:
    """The real uid of this machine's process whose command line has ARGUMENT (the operator inside)."""
    for status in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if argument.encode() in status.read_bytes() and b"buildah" not in status.read_bytes():
                uid_line = (status.parent / "status").read_text().split("Uid:")[1]
                return int(uid_line.split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
    raise AssertionError(f"no process with {argument}")
