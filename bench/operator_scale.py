"""Operator at scale: N targets created at once → time until all are Ready, then an idle period → writes.

    .venv/bin/python -m bench.operator_scale [--targets 200] [--mode external|pods] [--idle-seconds 60]
    .venv/bin/python -m bench.operator_scale --targets 500 --mode external --hung 50   # the day-2 figure
    .venv/bin/python -m bench.operator_scale --targets 1000 --mode external --hung 50 --trickle 50 \
        --restart-mid-idle                                                          # the restart figure

Runs against $E3T_KUBECONFIG, else the plane `python -m support.cluster up` left running, else a private one.
Mode `pods` (default): every target runs one kwok pod (engine hf, no GPU) and one real server app answers
at every pod's IP, the whole create → Deployment → pod → probe → Ready loop. Mode `external`: every target
points at one real target server (spec.endpoint.url), so the figures are the operator's own cost; with
--hung H, H of the targets point at a server that accepts connections and never answers, with --trickle T,
T more at one that answers a byte a second (external mode), and the figures are about the others. With
--restart-mid-idle the operator is killed (SIGKILL) and started again halfway through the idle period.
Prints one JSON object:
- all_ready_seconds: first create → last healthy target Ready (Ready=True for its current generation);
- create_to_ready_p50/p95_seconds: per target;
- operator_peak_rss_mib: the operator process's VmHWM;
- api_requests_per_target: the reconciler's own API requests (kopf's watch streams not included);
- all_probed_seconds: first create → the last target (hung ones included) has its first probe verdict in its
  status (a hung server's verdict waits for the probe's timeout, so it can come after all_ready_seconds);
- idle_*: over --idle-seconds from then on: status writes and child applies the operator counted (both
  processes' with a restart), and MODIFIED watch events on the targets seen by this script (goal: all zero,
  hung and trickling targets included: they are probed all along, and their status does not change);
- restarted_status_writes: what the restarted operator wrote (goal: 0; null without a restart).
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kubernetes
from eagle3_operator.status.observation import NOT_PROBED_YET
from eagle3_target.protocol import API_VERSION, GROUP, KIND, PLURAL, VERSION
from eagle3_target.tiny import write_tiny_model

from support.cluster import plane
from support.cluster.access import Cluster
from support.cluster.waiting import free_port
from support.crd import install_crd
from support.hostile_endpoints import TRICKLE, HostileEndpoint
from support.operator_process import OperatorProcess
from support.server_farm import PodServing, ServerFarm

REPO = Path(__file__).resolve().parents[1]


def manifest(name: str, mode: str, url: str, port: int) -> dict:
    spec: dict[str, Any]
    if mode == "external":
        spec = {"model": {"name": "tiny-llama"}, "engine": "hf", "endpoint": {"url": url}}
    else:
        source = {"hostPath": {"path": "/models/tiny-llama"}}
        spec = {"model": {"name": "tiny-llama", "source": source}, "engine": "hf", "tensorParallelSize": 0}
        spec |= {"replicas": 1, "port": port}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name},
        "spec": spec,
    }


def ready_condition(body: dict) -> dict[str, Any]:
    status = body.get("status") or {}
    return next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})


def is_probed(body: dict) -> bool:
    """The status holds a probe's verdict, not the first write made before any probe answered."""
    ready = ready_condition(body)
    return bool(ready) and NOT_PROBED_YET not in ready.get("message", "")


def is_ready(body: dict) -> bool:
    generation = body["metadata"]["generation"]
    ready = ready_condition(body)
    return ready.get("status") == "True" and ready.get("observedGeneration") == generation


class TargetWatch:
    """Watches the namespace's targets: when each first became Ready and first had a probe verdict, and how
    many times any was modified."""

    def __init__(self, api_client: kubernetes.client.ApiClient, namespace: str) -> None:
        self.custom = kubernetes.client.CustomObjectsApi(api_client)
        self.namespace = namespace
        self.ready_at: dict[str, float] = {}
        self.probed_at: dict[str, float] = {}
        self.modified = 0
        self._stopped = False
        self._watch = kubernetes.watch.Watch()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        """Watch until stopped; a stream that breaks (a refused first request right after the CRD is
        Established, a dropped connection) is opened again, and its fresh listing catches up."""
        while not self._stopped:
            try:
                stream = self._watch.stream(
                    self.custom.list_namespaced_custom_object,
                    GROUP,
                    VERSION,
                    self.namespace,
                    PLURAL,
                    timeout_seconds=3600,
                )
                for event in stream:
                    body, name = event["object"], event["object"]["metadata"]["name"]
                    if event["type"] == "MODIFIED":
                        self.modified += 1
                    if name not in self.ready_at and is_ready(body):
                        self.ready_at[name] = time.monotonic()
                    if name not in self.probed_at and is_probed(body):
                        self.probed_at[name] = time.monotonic()
            except Exception as error:  # stop() closes the stream, or the plane went away first
                if self._stopped:
                    return
                print(f"target watch broke ({error!r}); watching again", file=sys.stderr)
                time.sleep(0.5)

    def stop(self) -> None:
        self._stopped = True
        self._watch.stop()


def connect(stack: list) -> Cluster:
    import os

    if os.environ.get("E3T_KUBECONFIG"):
        return Cluster(Path(os.environ["E3T_KUBECONFIG"]))
    running = plane.find_running()
    if running is not None:
        return running.cluster()
    own = plane.start(Path(tempfile.mkdtemp(prefix="e3t-bench-plane-")), detached=False)
    stack.append(own.stop)
    return own.cluster()


def run(
    targets: int,
    mode: str,
    idle_seconds: float,
    timeout: float,
    hung: int = 0,
    trickle: int = 0,
    restart_mid_idle: bool = False,
) -> dict:
    cleanup: list = []
    try:
        cluster = connect(cleanup)
        install_crd(cluster)
        core = kubernetes.client.CoreV1Api(cluster.api_client)
        namespace = f"e3bench-{secrets.token_hex(3)}"
        core.create_namespace(kubernetes.client.V1Namespace(metadata={"name": namespace}))
        cleanup.append(lambda: core.delete_namespace(namespace))

        work = Path(tempfile.mkdtemp(prefix="e3t-bench-"))
        cleanup.append(lambda: shutil.rmtree(work, ignore_errors=True))
        farm = ServerFarm(write_tiny_model(work / "tiny-llama"))
        cleanup.append(farm.close)
        url = f"http://{farm.primary[0]}:{farm.primary[1]}"
        port = free_port()
        if (hung or trickle) and mode != "external":
            raise SystemExit("--hung and --trickle need --mode external (pods mode serves every pod IP)")
        wedged, trickling = HostileEndpoint(), HostileEndpoint(TRICKLE, pause=1.0)
        cleanup += [wedged.close, trickling.close]
        if mode == "pods":
            serving = PodServing(core, namespace, farm)
            serving.ports.add(port)
            cleanup.append(serving.close)

        operator = OperatorProcess(cluster.kubeconfig, work, [namespace], reprobe_seconds=15)
        operator.start()
        cleanup.append(operator.stop)
        watch = TargetWatch(cluster.api_client, namespace)
        cleanup.append(watch.stop)

        custom = kubernetes.client.CustomObjectsApi(cluster.api_client)
        names = [f"t{i:04d}" for i in range(targets)]
        hostile = {name: wedged.url for name in names[:hung]}
        hostile |= {name: trickling.url for name in names[hung : hung + trickle]}
        healthy = [name for name in names if name not in hostile]
        created_at: dict[str, float] = {}

        def create(name: str) -> None:
            created_at[name] = time.monotonic()
            target_url = f"{hostile[name]}/{name}" if name in hostile else url
            custom.create_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, manifest(name, mode, target_url, port)
            )

        started = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(create, names))
        while not all(n in watch.ready_at for n in healthy) and time.monotonic() - started < timeout:
            time.sleep(0.2)
        ready = [watch.ready_at[n] - created_at[n] for n in healthy if n in watch.ready_at]
        all_ready = max(watch.ready_at[n] for n in healthy) - started if len(ready) == len(healthy) else None
        while len(watch.probed_at) < len(names) and time.monotonic() - started < timeout:
            time.sleep(0.2)
        all_probed = max(watch.probed_at.values()) - started if len(watch.probed_at) == len(names) else None
        api_requests = operator.metric_total("eagle3_operator_api_requests_total")

        writes_before = operator.metric("eagle3_operator_status_writes_total")
        applies_before = operator.metric_total("eagle3_operator_child_applies_total")
        modified_before = watch.modified
        # What the idle period adds to the counters; a restarted process counts from 0 again.
        idle_writes = -writes_before
        idle_applies = -applies_before
        peak_rss = operator.peak_rss_bytes()
        restarted_writes = None
        if restart_mid_idle:
            time.sleep(idle_seconds / 2)
            idle_writes += operator.metric("eagle3_operator_status_writes_total")
            idle_applies += operator.metric_total("eagle3_operator_child_applies_total")
            peak_rss = operator.peak_rss_bytes()
            operator.kill()
            operator.start()
            time.sleep(idle_seconds / 2)
            restarted_writes = operator.metric("eagle3_operator_status_writes_total")
        else:
            time.sleep(idle_seconds)
        idle_writes += operator.metric("eagle3_operator_status_writes_total")
        idle_applies += operator.metric_total("eagle3_operator_child_applies_total")
        peak_rss = max(peak_rss, operator.peak_rss_bytes())
        quantiles = statistics.quantiles(ready, n=20) if len(ready) >= 2 else [float("nan")] * 19
        return {
            "targets": targets,
            "mode": mode,
            "hung": hung,
            "trickle": trickle,
            "ready": len(ready),
            "hostile_ready": sum(1 for n in hostile if n in watch.ready_at),  # goal: 0
            "all_ready_seconds": round(all_ready, 2) if all_ready is not None else None,
            "all_probed_seconds": round(all_probed, 2) if all_probed is not None else None,
            "create_to_ready_p50_seconds": round(statistics.median(ready), 3) if ready else None,
            "create_to_ready_p95_seconds": round(quantiles[18], 3),
            "operator_peak_rss_mib": round(peak_rss / 2**20, 1),
            "api_requests_per_target": round(api_requests / targets, 2),
            "status_writes_per_target": round(writes_before / targets, 2),
            "idle_seconds": idle_seconds,
            "idle_status_writes": idle_writes,
            "idle_child_applies": idle_applies,
            "idle_target_modifications_seen": watch.modified - modified_before,
            "restarted_status_writes": restarted_writes,
        }
    finally:
        for step in reversed(cleanup):
            try:
                step()
            except Exception as error:  # cleanup is best-effort; the figures are already taken
                print(f"cleanup step failed: {error}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", type=int, default=200)
    parser.add_argument("--mode", choices=("external", "pods"), default="pods")
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--timeout", type=float, default=600.0, help="give up waiting for Ready after this")
    parser.add_argument("--hung", type=int, default=0, help="targets whose server never answers (external)")
    parser.add_argument(
        "--trickle", type=int, default=0, help="targets whose server answers a byte a second (external)"
    )
    parser.add_argument(
        "--restart-mid-idle", action="store_true", help="kill and restart the operator mid idle period"
    )
    args = parser.parse_args()
    figures = run(
        args.targets,
        args.mode,
        args.idle_seconds,
        args.timeout,
        args.hung,
        args.trickle,
        args.restart_mid_idle,
    )
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
