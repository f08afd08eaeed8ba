"""Starts and stops the local control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and
kwok, each a process on free loopback ports with its log in the cluster directory.

Every address the cluster hands out is loopback: the API server and its Service range (127.2.0.0/16),
node IPs (127.0.0.1) and pod IPs (127.1.0.0/16). Controllers that would publish pod IPs into EndpointSlices
are off, because the API rejects loopback endpoint addresses; tests and the operator read pod IPs directly.
"""

from __future__ import annotations

import atexit
import functools
import json
import secrets
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import kubernetes
import yaml

from support.cluster import nodes
from support.cluster.access import BIN_DIR, REPO, Cluster
from support.cluster.processes import ClusterStartError, Process, spawn, stop, wait_until
from support.cluster.waiting import direct_opener

CLI_DIR = REPO / ".cache" / "cluster"  # where `python -m support.cluster up` keeps its cluster
STAGES = Path(__file__).with_name("kwok-stages.yaml")
SERVICE_CIDR = "127.2.0.0/16"
FALLBACK_POD_CIDR = f"127.{nodes.POD_NET}.0.0/24"
NODE_IP = "127.0.0.1"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
# EndpointSlices and Endpoints reject loopback addresses ("may not be in the loopback range"): these
# controllers would retry forever, a FailedToUpdateEndpointSlices or FailedToCreateEndpoint event each time.
DISABLED_CONTROLLERS = (
    "endpoints-controller",
    "endpointslice-controller",
    "endpointslice-mirroring-controller",
)
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "kubectl", "helm")


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int

    @classmethod
    def free(cls) -> Ports:
        """Ports the kernel has free right now, all distinct (held open together while picking)."""
        sockets = [socket.socket() for _ in range(5)]
        try:
            for s in sockets:
                s.bind(("127.0.0.1", 0))
            return cls(*(s.getsockname()[1] for s in sockets))
        finally:
            for s in sockets:
                s.close()


def etcd_argv(bin_dir: Path, directory: Path, ports: Ports) -> list[str]:
    client, peer = f"http://127.0.0.1:{ports.etcd_client}", f"http://127.0.0.1:{ports.etcd_peer}"
    return [
        str(bin_dir / "etcd"),
        "--name=default",
        f"--data-dir={directory / 'etcd'}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=default={peer}",
        "--unsafe-no-fsync=true",  # test data: skip fsync, it dominates etcd's latency on a shared disk
        "--log-level=warn",
    ]


def apiserver_argv(bin_dir: Path, directory: Path, ports: Ports) -> list[str]:
    sa_key = directory / "sa.key"
    return [
        str(bin_dir / "kube-apiserver"),
        f"--etcd-servers=http://127.0.0.1:{ports.etcd_client}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",  # else it looks for a default-route interface
        f"--secure-port={ports.apiserver}",
        f"--cert-dir={directory / 'pki'}",  # self-signed serving cert + CA, written before it serves
        f"--token-auth-file={directory / 'tokens.csv'}",
        "--authorization-mode=RBAC",
        f"--service-account-issuer={SA_ISSUER}",
        f"--service-account-key-file={sa_key}",
        f"--service-account-signing-key-file={sa_key}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--endpoint-reconciler-type=none",  # the `kubernetes` Service cannot have a loopback endpoint
        "--allow-privileged=true",
        "--profiling=false",
    ]


def _controller_flags(directory: Path, port: int) -> list[str]:
    """What the controller-manager and the scheduler share: the admin kubeconfig, no leader election (one
    instance), a loopback-only health port."""
    return [
        f"--kubeconfig={directory / 'kubeconfig'}",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        "--profiling=false",
    ]


def controller_manager_argv(bin_dir: Path, directory: Path, ports: Ports) -> list[str]:
    return [
        str(bin_dir / "kube-controller-manager"),
        *_controller_flags(directory, ports.controller_manager),
        "--controllers=" + ",".join(["*", *(f"-{name}" for name in DISABLED_CONTROLLERS)]),
        f"--service-account-private-key-file={directory / 'sa.key'}",
        f"--root-ca-file={directory / 'pki' / 'apiserver.crt'}",
    ]


def scheduler_argv(bin_dir: Path, directory: Path, ports: Ports) -> list[str]:
    return [str(bin_dir / "kube-scheduler"), *_controller_flags(directory, ports.scheduler)]


def kwok_argv(bin_dir: Path, directory: Path) -> list[str]:
    return [
        str(bin_dir / "kwok"),
        f"--kubeconfig={directory / 'kubeconfig'}",
        f"--config={STAGES}",
        f"--manage-nodes-with-annotation-selector={nodes.KWOK_ANNOTATION}",
        f"--cidr={FALLBACK_POD_CIDR}",
        f"--node-ip={NODE_IP}",
        "--node-lease-duration-seconds=40",
    ]


def kubeconfig(server: str, ca_file: Path, token: str) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority": str(ca_file)}}],
        "users": [{"name": "admin", "user": {"token": token}}],
        "contexts": [
            {"name": "local", "context": {"cluster": "local", "user": "admin", "namespace": "default"}}
        ],
        "current-context": "local",
    }


def _answers(url: str, context: ssl.SSLContext | None = None, token: str | None = None) -> bool:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with direct_opener(context).open(request, timeout=2) as response:
            return response.status == 200
    except (OSError, ValueError):
        return False


def _self_signed_probe_context() -> ssl.SSLContext:
    """KCM and the scheduler serve /healthz with an in-memory self-signed cert; there is no CA to check."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


@dataclass
class ControlPlane:
    directory: Path
    processes: list[Process]
    timings: dict[str, float] = field(default_factory=dict)  # seconds from start until each phase was ready

    @property
    def kubeconfig(self) -> Path:
        return self.directory / "kubeconfig"

    @property
    def state_file(self) -> Path:
        return self.directory / "state.json"

    def cluster(self) -> Cluster:
        return Cluster(self.kubeconfig, log_dir=self.directory)

    def alive(self) -> bool:
        return all(p.alive() for p in self.processes)

    def stop(self) -> None:
        stop(self.processes)
        self.state_file.unlink(missing_ok=True)

    def save(self) -> None:
        state = {"processes": [p.to_json() for p in self.processes], "timings": self.timings}
        self.state_file.write_text(json.dumps(state, indent=2))

    @classmethod
    def load(cls, directory: Path) -> ControlPlane | None:
        """The plane a state file describes, or None when there is none (or only a torn one)."""
        try:
            state = json.loads((directory / "state.json").read_text())
            return cls(directory, [Process.from_json(p) for p in state["processes"]], state["timings"])
        except (OSError, ValueError, KeyError, TypeError):
            return None


def write_credentials(directory: Path) -> str:
    """The admin's static bearer token (tokens.csv; returned) and the ServiceAccount signing key (sa.key)."""
    token = secrets.token_urlsafe(32)
    (directory / "tokens.csv").write_text(f'{token},admin,admin,"system:masters"\n')
    keygen = ["openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out"]
    subprocess.run([*keygen, str(directory / "sa.key")], check=True, capture_output=True)
    return token


def missing_binaries(bin_dir: Path = BIN_DIR) -> list[str]:
    return [name for name in BINARIES if not (bin_dir / name).exists()]


def start(directory: Path, *, detached: bool, gpu_nodes: int = 2, bin_dir: Path = BIN_DIR) -> ControlPlane:
    """Start a fresh plane in `directory` (emptied first) and return once pods can be scheduled and run.

    detached=False ties the processes to this Python process: they are stopped at interpreter exit, and the
    kernel kills them if the calling thread dies (so call this from the main thread). detached=True leaves
    them running for `python -m support.cluster down` to stop.
    """
    missing = missing_binaries(bin_dir)
    if missing:
        raise ClusterStartError(f"missing {', '.join(missing)} in {bin_dir}: run `make tools` first")
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    plane = ControlPlane(directory, [])
    if not detached:  # a no-op once plane.stop() ran: only live processes are signalled
        atexit.register(stop, plane.processes)
    began = time.monotonic()

    def run(name: str, argv: list[str]) -> Process:
        process = spawn(name, argv, directory / f"{name}.log", die_with_parent=not detached)
        plane.processes.append(process)
        return process

    def ready(phase: str) -> None:
        plane.timings[phase] = round(time.monotonic() - began, 2)

    try:
        ports = Ports.free()
        token = write_credentials(directory)
        etcd = run("etcd", etcd_argv(bin_dir, directory, ports))
        wait_until(
            lambda: _answers(f"http://127.0.0.1:{ports.etcd_client}/health"), "etcd /health", 60, [etcd]
        )
        ready("etcd")

        apiserver = run("kube-apiserver", apiserver_argv(bin_dir, directory, ports))
        ca_file = directory / "pki" / "apiserver.crt"
        wait_until(ca_file.exists, "kube-apiserver's serving certificate", 60, [etcd, apiserver])
        server = f"https://127.0.0.1:{ports.apiserver}"
        plane.kubeconfig.write_text(yaml.safe_dump(kubeconfig(server, ca_file, token)))
        verified = ssl.create_default_context(cafile=str(ca_file))
        wait_until(
            lambda: _answers(f"{server}/readyz", verified, token),
            "kube-apiserver /readyz",
            180,
            [etcd, apiserver],
        )
        ready("kube-apiserver")

        run("kube-controller-manager", controller_manager_argv(bin_dir, directory, ports))
        run("kube-scheduler", scheduler_argv(bin_dir, directory, ports))
        run("kwok", kwok_argv(bin_dir, directory))
        api_client = plane.cluster().api_client
        node_names = nodes.create_gpu_nodes(api_client, gpu_nodes)
        unverified = _self_signed_probe_context()
        for name, port in (
            ("kube-controller-manager", ports.controller_manager),
            ("kube-scheduler", ports.scheduler),
        ):
            url = f"https://127.0.0.1:{port}/healthz"
            wait_until(functools.partial(_answers, url, unverified), f"{name} /healthz", 120, plane.processes)
            ready(name)
        wait_until(
            lambda: nodes.all_schedulable(api_client, node_names),
            "GPU nodes Ready and untainted",
            120,
            plane.processes,
        )
        ready("nodes")
        plane.save()
        return plane
    except BaseException:
        stop(plane.processes)
        raise


def find_running(directory: Path = CLI_DIR) -> ControlPlane | None:
    """The plane `up` left in `directory`, if all its processes still run and the API server answers."""
    plane = ControlPlane.load(directory)
    if plane is None or not plane.alive():
        return None
    try:
        kubernetes.client.VersionApi(plane.cluster().api_client).get_code(_request_timeout=5)
    except Exception:  # unreachable, or no longer ours: either way not reusable
        return None
    return plane
