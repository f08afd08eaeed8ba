"""A kubelet for the test node that runs each pod's container as a real process, so the operator's view of
starting, crashing and restarting servers, and of a download Job's pod completing, comes from real exits."""

from __future__ import annotations

import base64
import ipaddress
import os
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes

from support.cluster import nodes, plane
from support.cluster.processes import kill_when_parent_dies, terminate
from support.cluster.waiting import eventually
from support.secret_volume import SecretVolume
from support.server_process import serve_command, status_code

# The kubelet's limits on a termination message read from the log (FallbackToLogsOnError): the last 80 lines,
# at most 2 KiB (kubelet's kuberuntime: maxContainerTerminationMessageLogLines and ...LogLength).
FALLBACK_LOG_LINES = 80
FALLBACK_LOG_BYTES = 2048
# Readiness probes and terminations run on a pool, so one hung server or slow exit stalls no other pod.
BACKGROUND_THREADS = 16


@dataclass
class _Container:
    """One pod's container as the kubelet tracks it."""

    pod: str
    uid: str
    ip: str
    spec: dict[str, Any]
    host_paths: dict[str, str]  # mountPath -> directory on this machine
    env: dict[str, str]  # the container's environment, valueFrom resolved
    restart_policy: str  # the pod's: Always (a Deployment's pods) or Never/OnFailure (a Job's)
    restarts: int = 0
    process: subprocess.Popen[bytes] | None = None
    started_at: str = ""
    ready: bool = False
    last_terminated: dict[str, Any] | None = None
    restart_at: float | None = None  # while backing off: when the next start is due
    logs: list[Path] = field(default_factory=list)
    probe: Future[bool] | None = None  # the readiness probe in flight


class Kubelet:
    """Plays the kubelet for the pods bound to the test node KUBELET_NODE in one namespace.

    Each pod's container (server pods and download Job pods have one; init containers are not run) runs as a
    real process with the pod's own command, at an IP the kubelet gives the pod from the node's podCIDR. Its
    state goes to the API server as a kubelet reports it: running and not ready until /readyz answers 200
    (the readiness probe; ready at once without one), and on exit the termination (exit code, reason Error,
    the message from the termination log or, under FallbackToLogsOnError, the log tail). A Deployment's pod
    (restartPolicy Always) then gets restartCount and a waiting CrashLoopBackOff until a restart after
    exponential back-off; a Job's pod ends Succeeded or Failed. The kubelet mounts a file at
    terminationMessagePath; here the server is told where that file is instead
    (EAGLE3_TARGET_TERMINATION_LOG). Volumes are directories on this machine: hostPath the same one, a
    persistentVolumeClaim its bound PersistentVolume's hostPath, a disk-backed emptyDir a fresh directory per
    pod, and a secret the Secret's keys written as files in a fresh directory per pod, in the kubelet's
    layout (`..data` links to a timestamped directory, each key links through `..data`, so an update swaps
    one link). Env values from secretKeyRef are read from the Secret; paths in args and env values are
    translated.

    Like a kubelet, it never waits on one pod: readiness probes (with the pod's own timeoutSeconds) and
    graceful terminations run on a thread pool, and the loop reads their results in later rounds. Servers
    are started by the loop's thread and die with it (PR_SET_PDEATHSIG follows the thread that spawned
    them), so the loop terminates them all, gracefully, before it ends.
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
        self._pool = ThreadPoolExecutor(BACKGROUND_THREADS, thread_name_prefix="kubelet")
        self._empty_dirs: list[str] = []  # removed by close()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kubelet", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        for empty_dir in self._empty_dirs:
            shutil.rmtree(empty_dir, ignore_errors=True)
        if self.errors:
            raise AssertionError("the test kubelet failed") from self.errors[0]

    def _loop(self) -> None:
        try:
            while not self._stop.wait(0.25):
                try:
                    self._round()
                except Exception as error:  # surfaced by close(); a kubelet keeps going
                    self.errors.append(error)
        finally:  # before this thread ends, which SIGKILLs what it started
            wait([self._pool.submit(terminate, c.process) for c in self.containers.values() if c.process])
            self._pool.shutdown(wait=True)

    def _round(self) -> None:
        selector = f"spec.nodeName={nodes.KUBELET_NODE}"
        pods = self.core.list_namespaced_pod(self.namespace, field_selector=selector).items
        live = {
            pod.metadata.name: pod
            for pod in pods
            if pod.metadata and pod.metadata.name and pod.metadata.deletion_timestamp is None
        }
        for name in [name for name in self.containers if name not in live]:
            self._remove(name)
        for name, pod in live.items():
            if name not in self.containers:
                self._admit(pod)
            self._sync(self.containers[name])

    def _admit(self, pod: kubernetes.client.V1Pod) -> None:
        raw = self.core.api_client.sanitize_for_serialization(pod)
        [spec] = raw["spec"]["containers"]
        volumes = {v["name"]: v for v in raw["spec"].get("volumes") or []}
        meta = pod.metadata
        assert meta and meta.name and meta.uid, "the API server returns pods whole"
        host_paths = {}
        for mount in spec.get("volumeMounts") or []:
            directory = self._volume_directory(volumes.get(mount["name"], {}))
            if directory is not None:
                host_paths[mount["mountPath"]] = str(Path(directory) / mount.get("subPath", ""))
        env = {
            e["name"]: e["value"] if "value" in e else self._secret_value(e["valueFrom"]["secretKeyRef"])
            for e in spec.get("env") or []
            if "value" in e or "secretKeyRef" in e.get("valueFrom", {})
        }
        restart_policy = raw["spec"].get("restartPolicy", "Always")
        container = _Container(
            meta.name, meta.uid, self._free_ips.pop(0), spec, host_paths, env, restart_policy
        )
        self.containers[container.pod] = container
        self._start(container)

    def _volume_directory(self, volume: dict[str, Any]) -> str | None:
        """The directory on this machine that a pod volume is, or None for one not made here (a
        memory-backed emptyDir)."""
        if "hostPath" in volume:
            return str(volume["hostPath"]["path"])
        if "persistentVolumeClaim" in volume:
            name = volume["persistentVolumeClaim"]["claimName"]
            claim = self.core.read_namespaced_persistent_volume_claim(name, self.namespace)
            assert claim.spec and claim.spec.volume_name, f"claim {name} is not bound"
            bound = self.core.read_persistent_volume(claim.spec.volume_name)
            assert bound.spec and bound.spec.host_path, f"volume {claim.spec.volume_name} is not a hostPath"
            return str(bound.spec.host_path.path)
        if "secret" in volume:
            directory = self._fresh_directory()
            write_secret_volume(self.core, self.namespace, volume["secret"], Path(directory))
            return directory
        if "emptyDir" in volume and volume["emptyDir"].get("medium") != "Memory":
            # A fresh directory per pod, as the kubelet gives each disk-backed emptyDir; short, since
            # vLLM binds its IPC sockets in TMPDIR and a socket path holds at most 107 bytes.
            return self._fresh_directory()
        return None

    def _fresh_directory(self) -> str:
        directory = tempfile.mkdtemp(prefix="e3t-")
        self._empty_dirs.append(directory)
        return directory

    def _secret_value(self, ref: dict[str, Any]) -> str:
        data = self.core.read_namespaced_secret(ref["name"], self.namespace).data or {}
        return base64.b64decode(data[ref["key"]]).decode()

    def _start(self, container: _Container) -> None:
        termination = self.log_dir / f"{container.pod}.termination-log"
        termination.write_text("")  # the kubelet gives every container run an empty file
        log = self.log_dir / f"{container.pod}-{container.restarts}.log"
        container.logs.append(log)
        argv = [*container.spec.get("command", []), *container.spec.get("args", [])]
        argv = [self._host_arg(container, arg) for arg in argv]
        if argv[0] == "eagle3-target":
            argv[:1] = serve_command()
        env = {name: self._host_arg(container, value) for name, value in container.env.items()}
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
        """The pod's view of an argument or env value on this machine: its IP for 0.0.0.0, host paths for
        mounts."""
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
        if container.probe is None:
            container.probe = self._pool.submit(self._readiness, container)
            return
        if not container.probe.done():
            return
        ready, container.probe = container.probe.result(), None
        if ready != container.ready:
            container.ready = ready
            self._report(container, {"running": {"startedAt": container.started_at}})

    @staticmethod
    def _readiness(container: _Container) -> bool:
        """The pod's readinessProbe: a GET of /readyz within its timeoutSeconds (the kubelet's default 1);
        without one, a running container is ready."""
        probe = container.spec.get("readinessProbe")
        if probe is None:
            return True
        port = next(p["containerPort"] for p in container.spec.get("ports") or [])
        return (
            status_code(f"http://{container.ip}:{port}/readyz", timeout=probe.get("timeoutSeconds", 1)) == 200
        )

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
        container.probe = None  # a probe of the exited process says nothing about the next one
        if container.restart_policy == "Never" or (container.restart_policy == "OnFailure" and code == 0):
            container.restart_at = float("inf")  # a Job's pod: it stays as it ended
            terminated, container.last_terminated = container.last_terminated, None  # no earlier run
            self._report(container, {"terminated": terminated}, "Succeeded" if code == 0 else "Failed")
            return
        delay = self.backoff_seconds * 2 ** min(container.restarts, 8)
        container.restart_at = time.monotonic() + delay
        name = container.spec["name"]
        back_off = f"back-off {delay:g}s restarting failed container={name} pod={container.pod}"
        self._report(container, {"waiting": {"reason": "CrashLoopBackOff", "message": back_off}})

    def _report(self, container: _Container, state: dict[str, Any], phase: str = "Running") -> None:
        ready = "True" if container.ready else "False"
        status = {
            "phase": phase,
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
                    "name": container.spec["name"],
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

    def _remove(self, name: str) -> None:
        """A deleted pod: its server is stopped gracefully in the background; its IP is free once it
        exited (a new pod must not find the old server still listening there)."""
        container = self.containers.pop(name)
        process = container.process
        if process is None:
            self._free_ips.append(container.ip)
            return
        stopping = self._pool.submit(terminate, process)
        stopping.add_done_callback(lambda _: self._free_ips.append(container.ip))


def write_secret_volume(
    core: kubernetes.client.CoreV1Api, namespace: str, source: dict[str, Any], directory: Path
) -> SecretVolume:
    """A secret volume (`source`: the pod's `secret` field; `items` picks keys and names their files) in
    `directory`, laid out as the kubelet writes it."""
    data = core.read_namespaced_secret(source["secretName"], namespace).data or {}
    files = {item["path"]: item["key"] for item in source.get("items") or []} or {key: key for key in data}
    return SecretVolume(
        directory, **{path: base64.b64decode(data[key]).decode() for path, key in files.items()}
    )


def register_node(core: kubernetes.client.CoreV1Api) -> str:
    """Register KUBELET_NODE (once per control plane: a later call finds it) and wait until it is
    schedulable; returns its name."""
    try:
        core.create_node(nodes.kubelet_node())  # type: ignore[arg-type]  # the client sends a dict body as is
    except kubernetes.client.ApiException as error:
        if error.status != 409:  # registered earlier
            raise
    eventually(lambda: nodes.all_schedulable(core.api_client, [nodes.KUBELET_NODE]), "the kubelet's node")
    return nodes.KUBELET_NODE


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
