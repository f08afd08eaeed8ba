"""Running the operator and target servers for tests and benchmarks: the operator as a real subprocess
against a cluster, and one real target-server app answering at any number of pod IP:port sockets.

Target servers: the target server's own `create_app` (tiny HF model, loaded once) behind one uvicorn server
per socket; a socket per pod IP:port is exactly what a server process inside that pod would bind.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import kubernetes
import uvicorn
from eagle3_operator.constants import SERVER_CONTAINER
from eagle3_target.protocol import API_VERSION, GROUP, PLURAL, VERSION

from tests.cluster import nodes, plane
from tests.cluster.access import Cluster
from tests.cluster.processes import kill_when_parent_dies, terminate
from tests.cluster.waiting import LOOPBACK, eventually, free_port
from tests.eagle3_target.server.server_process import serve_command

# Every pod setting of the spec at once (the names exist where the tests create them: the RuntimeClass,
# the ServiceAccount), for the rendering's dry run and the operator's round trip.
POD_SETTINGS: dict[str, Any] = {
    "env": [
        {"name": "NCCL_DEBUG", "value": "INFO"},
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ],
    "volumes": [{"name": "compile-cache", "emptyDir": {"sizeLimit": "10Gi"}}],
    "volumeMounts": [{"name": "compile-cache", "mountPath": "/cache"}],
    "podMetadata": {"labels": {"kueue.x-k8s.io/queue-name": "gpus"}, "annotations": {"team": "ml"}},
    "runtimeClassName": "e3t-test-runtime",
    "serviceAccountName": "bucket-reader",
    "schedulerName": "gang-scheduler",
    "topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}
    ],
    "shmSize": "32Gi",
    "securityContext": {"platformAssignedIds": True},
    "rollout": {"maxSurge": 1, "maxUnavailable": 0},
}

# The operator tests wait longer by default: a reconcile may sit out a retry backoff first.
wait_for = functools.partial(eventually, timeout=90.0, interval=0.3)


class OperatorProcess:
    """`eagle3-operator` as a subprocess: startable, killable (SIGKILL) and restartable, with its metrics.
    The kernel kills it if the test process dies without stopping it."""

    def __init__(
        self,
        kubeconfig: Path,
        log_dir: Path,
        namespaces: Sequence[str],
        reprobe_seconds: float = 1.0,
        extra_args: Sequence[str] = (),
        name: str = "operator",
    ) -> None:
        self.kubeconfig = kubeconfig
        self.log_dir = log_dir
        self.namespaces = list(namespaces)
        self.reprobe_seconds = reprobe_seconds
        self.extra_args = list(extra_args)  # read at each start: change them between a stop and a start
        self.name = name
        self.process: subprocess.Popen[bytes] | None = None
        self.metrics_port = 0
        self.liveness_port = 0
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}-{self.starts}.log"

    @staticmethod
    def command() -> list[str]:
        """How to run `eagle3-operator` from this Python environment."""
        exe = shutil.which("eagle3-operator", path=str(Path(sys.executable).parent))
        return [exe] if exe else [sys.executable, "-c", "from eagle3_operator.cli import main; main()"]

    def environment(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "NO_PROXY": "*"}

    def start(self) -> None:
        self.starts += 1
        self.metrics_port, self.liveness_port = free_port(), free_port()
        argv = [
            *self.command(),
            *(f"--namespace={namespace}" for namespace in self.namespaces),
            f"--liveness=http://{LOOPBACK}:{self.liveness_port}/healthz",
            f"--metrics-port={self.metrics_port}",
            f"--metrics-address={LOOPBACK}",
            f"--reprobe-seconds={self.reprobe_seconds}",
            "--api-timeout-seconds=10",
            *self.extra_args,
        ]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                preexec_fn=kill_when_parent_dies,
            )
        wait_for(self._alive, "the operator's liveness endpoint", timeout=60)

    def _alive(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            raise AssertionError(f"operator exited:\n{self.log()[-4000:]}")
        try:
            return httpx.get(f"http://{LOOPBACK}:{self.liveness_port}/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def kill(self) -> None:
        """SIGKILL: no cleanup at all, as when a node dies under the operator."""
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None:
            terminate(self.process)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def peak_rss_bytes(self) -> int:
        """The process's peak resident memory so far (VmHWM)."""
        assert self.process is not None
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE).group(1)) * 1024

    def metric_total(self, name: str) -> float:
        """The sum of a metric's samples over all label values."""
        text = httpx.get(f"http://{LOOPBACK}:{self.metrics_port}/metrics", timeout=5).text
        return sum(
            float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
        )

    def metric(self, name: str, **labels: str) -> float:
        """One sample from the operator's /metrics (0 when absent)."""
        text = httpx.get(f"http://{LOOPBACK}:{self.metrics_port}/metrics", timeout=5).text
        wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
        pattern = re.escape(name) + (r"\{" + re.escape(wanted) + r"\}" if labels else "") + r" (\S+)"
        match = re.search(rf"^{pattern}$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0


class ServerFarm:
    """One real target-server app (model loaded once) listening on any number of IP:port sockets."""

    def __init__(self, model_dir: Path, auth_token_file: Path | None = None) -> None:
        from eagle3_target.server.app import create_app
        from eagle3_target.server.settings import ServerSettings

        settings = ServerSettings(
            model=str(model_dir),
            engine="hf",
            dtype="float32",
            model_name="tiny-llama",
            auth_token_file=auth_token_file,
        )
        self.app = create_app(settings)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="server-farm", daemon=True)
        self._thread.start()
        self._servers: dict[tuple[str, int], tuple[uvicorn.Server, Any]] = {}
        self.primary = (LOOPBACK, free_port())
        self._serve(*self.primary, lifespan="on")  # loads the model; the other sockets share it
        url = f"http://{LOOPBACK}:{self.primary[1]}/readyz"
        wait_for(lambda: _status(url) == 200, "the target server to load its model", timeout=180)

    def _serve(self, host: str, port: int, lifespan: str) -> None:
        config = uvicorn.Config(self.app, host=host, port=port, lifespan=lifespan, log_level="warning")
        server = uvicorn.Server(config)
        future = asyncio.run_coroutine_threadsafe(server.serve(), self._loop)
        self._servers[host, port] = (server, future)

        def started() -> bool:
            if future.done():
                raise AssertionError(f"server on {host}:{port} stopped: {future.exception()!r}")
            return server.started

        wait_for(started, f"a server socket on {host}:{port}", timeout=30, interval=0.05)

    def bind(self, host: str, port: int) -> str:
        """Answer at host:port (a pod's IP and spec.port); returns the base URL."""
        if (host, port) not in self._servers:
            self._serve(host, port, lifespan="off")
        return f"http://{host}:{port}"

    def unbind(self, host: str, port: int) -> None:
        entry = self._servers.pop((host, port), None)
        if entry is not None:
            entry[0].should_exit = True
            entry[1].result(timeout=30)

    def close(self) -> None:
        for address in [a for a in self._servers if a != self.primary]:
            self.unbind(*address)
        self.unbind(*self.primary)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


class PodServing:
    """Keeps a real server answering at IP:port of every running pod in a namespace (as the pod's own
    server process would), for the ports it has been told to serve."""

    def __init__(self, core: kubernetes.client.CoreV1Api, namespace: str, farm: ServerFarm) -> None:
        self.core = core
        self.namespace = namespace
        self.farm = farm
        self.ports: set[int] = set()
        self.bound: set[tuple[str, int]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pod-serving", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            pods = self.core.list_namespaced_pod(self.namespace).items
            for pod in pods:
                for port in list(self.ports):
                    address = (pod.status.pod_ip, port)
                    if pod.status.pod_ip and address not in self.bound:
                        self.farm.bind(*address)
                        self.bound.add(address)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for address in self.bound:
            self.farm.unbind(*address)


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.TransportError:
        return None


# The kubelet's limits on a termination message read from the log (FallbackToLogsOnError): the last 80 lines,
# at most 2 KiB (kubelet's kuberuntime: maxContainerTerminationMessageLogLines and ...LogLength).
FALLBACK_LOG_LINES = 80
FALLBACK_LOG_BYTES = 2048
DEFAULT_TERMINATION_PATH = "/dev/termination-log"


@dataclass
class _Container:
    """One pod's server container as the kubelet tracks it."""

    pod: str
    uid: str
    ip: str
    spec: dict[str, Any]
    host_paths: dict[str, str]  # mountPath -> directory on this machine
    restarts: int = 0
    process: subprocess.Popen[bytes] | None = None
    started_at: str = ""
    ready: bool = False
    last_terminated: dict[str, Any] | None = None
    restart_at: float | None = None  # while backing off: when the next start is due
    logs: list[Path] = field(default_factory=list)


class Kubelet:
    """Plays the kubelet for the pods bound to the test node KUBELET_NODE in one namespace.

    Each pod's server container runs as a real process with the pod's own command, listening at an IP the
    kubelet gives the pod from the node's podCIDR. Its state goes to the API server as a kubelet reports it:
    running and not ready until /readyz answers 200 (the readiness probe), and on exit the termination
    (exit code, reason Error, the message from the termination log or, under FallbackToLogsOnError, the log
    tail), restartCount and a waiting CrashLoopBackOff until a restart after exponential back-off. The
    kubelet mounts a file at terminationMessagePath; here the server is told where that file is instead
    (EAGLE3_TARGET_TERMINATION_LOG), and hostPath volumes are the same directories on this machine.
    """

    def __init__(
        self, core: kubernetes.client.CoreV1Api, namespace: str, log_dir: Path, backoff_seconds: float = 1.0
    ) -> None:
        self.core = core
        self.namespace = namespace
        self.log_dir = log_dir
        self.backoff_seconds = backoff_seconds
        self.containers: dict[str, _Container] = {}
        self.errors: list[BaseException] = []  # what broke its loop; close() raises the first
        self._free_ips = [
            str(ip) for ip in ipaddress.ip_network(nodes.gpu_node_pod_cidr(nodes.KUBELET_NODE_INDEX)).hosts()
        ][1:]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kubelet", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for container in self.containers.values():
            if container.process is not None:
                terminate(container.process)
        if self.errors:
            raise AssertionError("the test kubelet failed") from self.errors[0]

    def _loop(self) -> None:
        while not self._stop.wait(0.25):
            try:
                self._round()
            except Exception as error:  # surfaced by close(); a kubelet keeps going
                self.errors.append(error)

    def _round(self) -> None:
        selector = f"spec.nodeName={nodes.KUBELET_NODE}"
        pods = self.core.list_namespaced_pod(self.namespace, field_selector=selector).items
        live = {pod.metadata.name: pod for pod in pods if pod.metadata.deletion_timestamp is None}
        for name in [name for name in self.containers if name not in live]:
            self._remove(name)
        for name, pod in live.items():
            if name not in self.containers:
                self._admit(pod)
            self._sync(self.containers[name])

    def _admit(self, pod: kubernetes.client.V1Pod) -> None:
        raw = self.core.api_client.sanitize_for_serialization(pod)
        [spec] = [c for c in raw["spec"]["containers"] if c["name"] == SERVER_CONTAINER]
        volumes = {v["name"]: v for v in raw["spec"].get("volumes") or []}
        host_paths = {
            mount["mountPath"]: str(
                Path(volumes[mount["name"]]["hostPath"]["path"]) / mount.get("subPath", "")
            )
            for mount in spec.get("volumeMounts") or []
            if "hostPath" in volumes.get(mount["name"], {})
        }
        container = _Container(pod.metadata.name, pod.metadata.uid, self._free_ips.pop(0), spec, host_paths)
        self.containers[container.pod] = container
        self._start(container)

    def _start(self, container: _Container) -> None:
        termination = self.log_dir / f"{container.pod}.termination-log"
        termination.write_text("")  # the kubelet gives every container run an empty file
        log = self.log_dir / f"{container.pod}-{container.restarts}.log"
        container.logs.append(log)
        argv = [*container.spec.get("command", []), *container.spec.get("args", [])]
        argv = [self._host_arg(container, arg) for arg in argv]
        if argv[0] == "eagle3-target":
            argv[:1] = serve_command()
        env = {e["name"]: e["value"] for e in container.spec.get("env") or [] if "value" in e}
        env |= {"CUDA_VISIBLE_DEVICES": "", "EAGLE3_TARGET_TERMINATION_LOG": str(termination)}
        with log.open("wb") as out:
            container.process = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                preexec_fn=kill_when_parent_dies,
            )
        container.started_at = _now()
        container.ready = False
        container.restart_at = None
        self._report(container, {"running": {"startedAt": container.started_at}})

    def _host_arg(self, container: _Container, arg: str) -> str:
        """The pod's view of an argument on this machine: its IP for 0.0.0.0, host paths for mounts."""
        if arg == "0.0.0.0":
            return container.ip
        for mount, host in container.host_paths.items():
            if arg == mount or arg.startswith(mount + "/"):
                return host + arg[len(mount) :]
        return arg

    def _sync(self, container: _Container) -> None:
        process = container.process
        if container.restart_at is not None:
            if time.monotonic() >= container.restart_at:
                container.restarts += 1
                self._start(container)
            return
        assert process is not None
        code = process.poll()
        if code is not None:
            self._terminated(container, code)
            return
        port = self._port(container)
        ready = _status(f"http://{container.ip}:{port}/readyz") == 200
        if ready != container.ready:
            container.ready = ready
            self._report(container, {"running": {"startedAt": container.started_at}})

    def _terminated(self, container: _Container, code: int) -> None:
        message = (self.log_dir / f"{container.pod}.termination-log").read_text()
        policy = container.spec.get("terminationMessagePolicy", "File")
        if not message and code != 0 and policy == "FallbackToLogsOnError":
            tail = container.logs[-1].read_bytes().splitlines()[-FALLBACK_LOG_LINES:]
            message = b"\n".join(tail)[-FALLBACK_LOG_BYTES:].decode(errors="replace")
        container.last_terminated = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "message": message,
            "startedAt": container.started_at,
            "finishedAt": _now(),
            "containerID": f"harness://{container.process.pid if container.process else 0}",
        }
        container.ready = False
        delay = self.backoff_seconds * 2 ** min(container.restarts, 8)
        container.restart_at = time.monotonic() + delay
        back_off = f"back-off {delay:g}s restarting failed container={SERVER_CONTAINER} pod={container.pod}"
        self._report(container, {"waiting": {"reason": "CrashLoopBackOff", "message": back_off}})

    def _report(self, container: _Container, state: dict[str, Any]) -> None:
        ready = "True" if container.ready else "False"
        status = {
            "phase": "Running",
            "podIP": container.ip,
            "podIPs": [{"ip": container.ip}],
            "hostIP": plane.NODE_IP,
            "startTime": container.started_at if container.restarts == 0 else None,
            "conditions": [
                {"type": kind, "status": ready, "lastTransitionTime": _now()}
                for kind in ("Ready", "ContainersReady")
            ]
            + [{"type": "Initialized", "status": "True", "lastTransitionTime": _now()}],
            "containerStatuses": [
                {
                    "name": SERVER_CONTAINER,
                    "image": container.spec["image"],
                    "imageID": "",
                    "ready": container.ready,
                    "started": "running" in state,
                    "restartCount": container.restarts,
                    "state": state,
                    "lastState": {"terminated": container.last_terminated}
                    if container.last_terminated
                    else {},
                }
            ],
        }
        if status["startTime"] is None:
            del status["startTime"]
        try:
            self.core.patch_namespaced_pod_status(
                container.pod,
                self.namespace,
                {"status": status},
                _content_type="application/strategic-merge-patch+json",  # conditions merge by type
            )
        except kubernetes.client.ApiException as error:
            if error.status != 404:  # deleted meanwhile: the next round removes it
                raise

    def _port(self, container: _Container) -> int:
        return next(p["containerPort"] for p in container.spec.get("ports") or [])

    def _remove(self, name: str) -> None:
        container = self.containers.pop(name)
        if container.process is not None:
            terminate(container.process)
        self._free_ips.append(container.ip)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def target_manifest(name: str, port: int, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "Eagle3Target",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "tiny-llama", "source": {"hostPath": {"path": "/models/tiny-llama"}}},
            "engine": "hf",
            "tensorParallelSize": 1,
            "replicas": 1,
            "port": port,
            "startupTimeoutSeconds": 600,
        }
        | spec,
    }


class Targets:
    """Eagle3Target and child access for one namespace."""

    def __init__(self, cluster: Cluster, namespace: str) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.custom = kubernetes.client.CustomObjectsApi(cluster.api_client)
        self.core = kubernetes.client.CoreV1Api(cluster.api_client)
        self.apps = kubernetes.client.AppsV1Api(cluster.api_client)

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, manifest)

    def get(self, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)
        except kubernetes.client.ApiException as error:
            if error.status == 404:
                return None
            raise

    def patch_spec(self, name: str, spec: dict[str, Any]) -> int:
        """Merge-patch the spec; returns the new metadata.generation."""
        body = self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name, {"spec": spec}
        )
        return body["metadata"]["generation"]

    def delete(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)

    def deployment(self, name: str) -> kubernetes.client.V1Deployment | None:
        try:
            return self.apps.read_namespaced_deployment(name, self.namespace)
        except kubernetes.client.ApiException as error:
            if error.status == 404:
                return None
            raise

    def service(self, name: str) -> kubernetes.client.V1Service | None:
        try:
            return self.core.read_namespaced_service(name, self.namespace)
        except kubernetes.client.ApiException as error:
            if error.status == 404:
                return None
            raise

    def pdb(self, name: str) -> kubernetes.client.V1PodDisruptionBudget | None:
        policy = kubernetes.client.PolicyV1Api(self.cluster.api_client)
        try:
            return policy.read_namespaced_pod_disruption_budget(name, self.namespace)
        except kubernetes.client.ApiException as error:
            if error.status == 404:
                return None
            raise

    def pods(self, name: str) -> list[kubernetes.client.V1Pod]:
        """The target's server pods (its Service's selector; hydration pods carry only the instance label)."""
        selector = f"app.kubernetes.io/name=eagle3-target,app.kubernetes.io/instance={name}"
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
        return [p for p in pods if p.metadata.deletion_timestamp is None]

    def events(self, name: str) -> list[kubernetes.client.CoreV1Event]:
        selector = f"involvedObject.name={name},involvedObject.kind=Eagle3Target"
        return self.core.list_namespaced_event(self.namespace, field_selector=selector).items

    def ready_status(
        self, name: str, generation: int | None = None, replicas: int | None = None
    ) -> dict | None:
        """The status once Ready=True for `generation` (default: the current one) with `replicas` serving."""
        body = self.get(name)
        if body is None:
            return None
        status = body.get("status") or {}
        ready = condition(status, "Ready")
        generation = generation or body["metadata"]["generation"]
        if ready.get("status") != "True" or ready.get("observedGeneration") != generation:
            return None
        if status.get("observedGeneration") != generation:
            return None
        if replicas is not None and status.get("readyReplicas") != replicas:
            return None
        return status


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})
