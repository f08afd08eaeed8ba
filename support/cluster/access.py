"""What tests hold of a running cluster: its kubeconfig, an admin API client, kubectl and helm bound to it,
and ServiceAccount credentials minted through the TokenRequest API (the operator runs with those)."""

from __future__ import annotations

import functools
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import kubernetes
import yaml

REPO = Path(__file__).resolve().parents[2]
BIN_DIR = REPO / ".cache" / "bin"
# helm's state dirs, inside .cache, so no user state leaks in (every helm run here sets them).
HELM_HOME = REPO / ".cache" / "helm"
HELM_ENV = {f"HELM_{kind.upper()}_HOME": str(HELM_HOME / kind) for kind in ("cache", "config", "data")}


@dataclass(frozen=True)
class Cluster:
    kubeconfig: Path
    bin_dir: Path = BIN_DIR
    log_dir: Path | None = None  # None when the cluster was not started by this harness

    @functools.cached_property
    def api_client(self) -> kubernetes.client.ApiClient:
        """An admin client (system:masters); build typed APIs on it, e.g. CoreV1Api(cluster.api_client)."""
        return kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))

    @property
    def kubectl_path(self) -> Path:
        return self.bin_dir / "kubectl"

    @property
    def helm_path(self) -> Path:
        return self.bin_dir / "helm"

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster; with check=True a non-zero exit raises, quoting stderr."""
        cache = REPO / ".cache" / "kubectl"
        argv = [str(self.kubectl_path), f"--kubeconfig={self.kubeconfig}", f"--cache-dir={cache}", *args]
        return self._run(argv, input, check)

    def helm(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run helm against this cluster, with its own cache and config dirs so no user state leaks in."""
        return self._run([str(self.helm_path), f"--kubeconfig={self.kubeconfig}", *args], input, check)

    def _run(self, argv: list[str], input: str | None, check: bool) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), **HELM_ENV}
        result = subprocess.run(argv, input=input, capture_output=True, text=True, env=env, timeout=120)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}:\n{result.stderr}")
        return result

    def service_account_token(
        self, namespace: str, name: str, *, expiration_seconds: int = 3600, audiences: list[str] | None = None
    ) -> str:
        """A bound token for an existing ServiceAccount; no audiences means the API server's own."""
        request = kubernetes.client.AuthenticationV1TokenRequest(
            spec=kubernetes.client.V1TokenRequestSpec(
                audiences=audiences or [], expiration_seconds=expiration_seconds
            )
        )
        core = kubernetes.client.CoreV1Api(self.api_client)
        granted = core.create_namespaced_service_account_token(name, namespace, request)
        assert granted.status is not None and granted.status.token, "the API server granted no token"
        return granted.status.token

    def write_service_account_kubeconfig(self, namespace: str, name: str, path: Path) -> Path:
        """A kubeconfig that authenticates as system:serviceaccount:NAMESPACE:NAME (what an in-cluster pod
        of that ServiceAccount would be), pointing at the same server and CA as the admin one."""
        admin = yaml.safe_load(self.kubeconfig.read_text())
        context = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
        cluster = next(c for c in admin["clusters"] if c["name"] == context["cluster"])
        user = f"{namespace}:{name}"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [cluster],
            "users": [{"name": user, "user": {"token": self.service_account_token(namespace, name)}}],
            "contexts": [
                {"name": user, "context": {"cluster": cluster["name"], "user": user, "namespace": namespace}}
            ],
            "current-context": user,
        }
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path
