"""An installed release of the operator chart, and its operator run as a local process (no image runs on the
local control plane): authenticated as the release's ServiceAccount and started with the args the release's
Deployment gives the container, so it has exactly the chart's RBAC and settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from support.cluster.access import Cluster
from support.operator_process import OperatorProcess

# Where OperatorProcess serves the probes and metrics (free local ports): the Deployment's own are dropped.
_LOCAL_ENDPOINT_FLAGS = ("--liveness=", "--readiness=", "--metrics-port=")


def release_objects(cluster: Cluster, release: str, namespace: str) -> list[dict[str, Any]]:
    """The objects the release installed (`helm get manifest`)."""
    manifest = cluster.helm("get", "manifest", release, "--namespace", namespace).stdout
    return [doc for doc in yaml.safe_load_all(manifest) if doc]


def service_account(cluster: Cluster, release: str, namespace: str) -> str:
    """The name of the ServiceAccount the release's operator runs as."""
    (deployment,) = [o for o in release_objects(cluster, release, namespace) if o["kind"] == "Deployment"]
    return str(deployment["spec"]["template"]["spec"]["serviceAccountName"])


class ReleaseOperator(OperatorProcess):
    """The release's operator: its ServiceAccount's credentials, its container's args (namespaces served,
    Prometheus namespace, PodMonitor labels, leader election) and POD_NAMESPACE, as its pod would have."""

    def __init__(self, cluster: Cluster, release: str, namespace: str, log_dir: Path) -> None:
        (deployment,) = [o for o in release_objects(cluster, release, namespace) if o["kind"] == "Deployment"]
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        args = [arg for arg in container["args"] if not arg.startswith(_LOCAL_ENDPOINT_FLAGS)]
        kubeconfig = cluster.write_service_account_kubeconfig(
            namespace, pod["serviceAccountName"], log_dir / "operator.kubeconfig"
        )
        super().__init__(kubeconfig, log_dir, namespaces=[], reprobe_seconds=1.0, extra_args=args)
        self.release_namespace = namespace

    def environment(self) -> dict[str, str]:
        return {**super().environment(), "POD_NAMESPACE": self.release_namespace}
