"""The operator against the real control plane: kwok pods, real target servers at the pods' IPs, real status.

One operator process serves the whole module (it serves namespaces e3op-*); each test has its own namespace.
"""

from __future__ import annotations

import http.server
import json
import secrets
import threading
import time
from typing import Any

import httpx
import kubernetes
import pytest
from eagle3_target.protocol import GROUP, PLURAL, VERSION

from support.cluster import nodes
from support.cluster.access import Cluster
from support.cluster.waiting import eventually, free_port
from support.operator_process import OperatorProcess
from support.server_farm import PodServing, ServerFarm
from support.targets import POD_SETTINGS, Targets, condition, target_manifest

pytestmark = pytest.mark.usefixtures("operator")


def server_info(servers: ServerFarm) -> dict[str, Any]:
    return httpx.get(f"http://{servers.primary[0]}:{servers.primary[1]}/v1/info", timeout=5).json()


def test_lifecycle_ready_scale_rollout_suspend(
    targets: Targets,
    pod_serving: PodServing,
    servers: ServerFarm,
    operator: OperatorProcess,
    cluster: Cluster,
):
    port = free_port()
    created = targets.create(target_manifest("llama", port))
    uid = created["metadata"]["uid"]

    # Children appear, owned by the target.
    deployment = eventually(lambda: targets.deployment("llama"), "the Deployment")
    service = eventually(lambda: targets.service("llama"), "the Service")
    for child in (deployment, service):
        owner = child.metadata.owner_references[0]
        assert (owner.kind, owner.uid, owner.controller) == ("Eagle3Target", uid, True)
    assert deployment.spec.template.spec.containers[0].resources.limits["nvidia.com/gpu"] == "1"

    # The kwok pod is Ready, but nothing answers at its IP yet: not a ready endpoint, target not Ready.
    def unserved_endpoint() -> dict | None:
        status = (targets.get("llama") or {}).get("status") or {}
        endpoints = status.get("endpoints") or []
        return status if endpoints and not endpoints[0]["ready"] else None

    status = eventually(unserved_endpoint, "an endpoint published as not ready")
    assert condition(status, "Ready")["status"] == "False"
    assert status["endpoints"][0]["address"].startswith(f"http://127.{nodes.POD_NET}.")

    # A real server answers at the pod's IP:port → Ready, with endpoint, model and fingerprint.
    pod_serving.ports.add(port)
    status = eventually(lambda: targets.ready_status("llama", replicas=1), "Ready with one endpoint")
    info = server_info(servers)
    pod = targets.pods("llama")[0]
    assert status["endpoints"] == [
        {
            "pod": pod.metadata.name,
            "address": f"http://{pod.status.pod_ip}:{port}",
            "ready": True,
            "node": pod.spec.node_name,
        }
    ]
    assert status["model"]["fingerprint"] == info["fingerprint"]
    assert (status["model"]["name"], status["model"]["numHiddenLayers"]) == (
        "tiny-llama",
        info["num_hidden_layers"],
    )
    assert status["url"] == f"http://llama.{targets.namespace}.svc:{port}"
    assert status["phase"] == "Ready" and status["readyDesired"] == "1/1"
    assert "app.kubernetes.io/instance=llama" in status["selector"]
    cluster.kubectl("wait", "--for=condition=Ready", "--timeout=60s", "-n", targets.namespace, "e3t/llama")
    assert any(e.reason == "AllReplicasReady" and e.type == "Normal" for e in targets.events("llama"))

    # Idle: several re-probe rounds later nothing was written, neither status nor children.
    before = _written_by_operator(targets, "llama")
    writes, applies = operator.metric("eagle3_operator_status_writes_total"), _applies(operator)
    time.sleep(5)
    assert _written_by_operator(targets, "llama") == before
    assert (operator.metric("eagle3_operator_status_writes_total"), _applies(operator)) == (writes, applies)
    assert operator.metric("eagle3_operator_probes_total", outcome="ready") > 0
    assert operator.metric("eagle3_operator_targets", phase="Ready") >= 1
    assert operator.metric("eagle3_operator_ready_endpoints") >= 1
    assert operator.metric("eagle3_operator_reconciles_total", result="ok") > 0
    assert operator.metric("eagle3_operator_reconcile_duration_seconds_count") > 0

    # Scale through the scale subresource (what HPA and `kubectl scale` use).
    cluster.kubectl("scale", "-n", targets.namespace, "e3t/llama", "--replicas=2")
    status = eventually(lambda: targets.ready_status("llama", replicas=2), "Ready with two endpoints")
    assert status["replicas"] == 2 and len(status["endpoints"]) == 2
    scale = targets.custom.get_namespaced_custom_object_scale(
        GROUP, VERSION, targets.namespace, PLURAL, "llama"
    )
    assert (scale["status"]["replicas"], scale["status"]["selector"]) == (2, status["selector"])
    assert (
        eventually(lambda: targets.pdb("llama"), "a PodDisruptionBudget at two replicas").spec.max_unavailable
        == 1
    )

    # A spec change rolls the pods; Ready again only for the new generation, on new pods.
    old_pods = {p.metadata.name for p in targets.pods("llama")}
    generation = targets.patch_spec("llama", {"startupTimeoutSeconds": 900})
    status = eventually(
        lambda: targets.ready_status("llama", generation, replicas=2), "Ready after the rollout"
    )
    assert {e["pod"] for e in status["endpoints"]}.isdisjoint(old_pods)
    assert targets.deployment("llama").spec.progress_deadline_seconds == 1200

    # Suspend: no pods, Suspended; resume brings it back.
    generation = targets.patch_spec("llama", {"suspend": True})

    def suspended() -> dict | None:
        status = (targets.get("llama") or {}).get("status") or {}
        progressing = condition(status, "Progressing")
        done = status.get("phase") == "Suspended" and progressing.get("reason") == "Suspended"
        return status if done and status.get("observedGeneration") == generation else None

    status = eventually(suspended, "Suspended with no pods")
    assert targets.deployment("llama").spec.replicas == 0
    eventually(lambda: targets.pdb("llama") is None, "the PodDisruptionBudget removed while suspended")
    assert status["endpoints"] == [] and condition(status, "Ready")["reason"] == "Suspended"
    generation = targets.patch_spec("llama", {"suspend": False})
    eventually(lambda: targets.ready_status("llama", generation, replicas=2), "Ready after resuming")


def _written_by_operator(targets: Targets, name: str) -> tuple:
    """What changes when the operator writes: the target's resourceVersion (only the operator writes it
    here), and the children's spec generation and the operator's managedFields entry (the controllers
    write the Deployment's status, which moves its resourceVersion but neither of these)."""

    def manager_time(child: Any) -> Any:
        return [
            (f.operation, f.time) for f in child.metadata.managed_fields if f.manager == "eagle3-operator"
        ]

    deployment, service = targets.deployment(name), targets.service(name)
    return (
        targets.get(name)["metadata"]["resourceVersion"],
        deployment.metadata.generation,
        manager_time(deployment),
        service.metadata.resource_version,
        manager_time(service),
    )


def _applies(operator: OperatorProcess) -> float:
    return sum(
        operator.metric("eagle3_operator_child_applies_total", kind=k) for k in ("Deployment", "Service")
    )


def test_drift_is_repaired(targets: Targets):
    targets.create(target_manifest("drift", free_port()))
    deployment = eventually(lambda: targets.deployment("drift"), "the Deployment")
    service = eventually(lambda: targets.service("drift"), "the Service")

    targets.core.delete_namespaced_service("drift", targets.namespace)
    recreated = eventually(
        lambda: (s := targets.service("drift")) is not None and s.metadata.uid != service.metadata.uid and s,
        "the deleted Service to come back",
    )
    assert recreated.spec.ports[0].name == "http"

    targets.apps.patch_namespaced_deployment(
        "drift",
        targets.namespace,
        {
            "spec": {
                "replicas": 3,
                "template": {"spec": {"containers": [{"name": "server", "image": "evil:1"}]}},
            }
        },
    )
    repaired = eventually(
        lambda: (
            (d := targets.deployment("drift")).spec.replicas == 1
            and d.spec.template.spec.containers[0].image != "evil:1"
            and d
        ),
        "the edited Deployment to be repaired",
    )
    assert repaired.metadata.uid == deployment.metadata.uid  # repaired in place, not recreated


def test_status_edited_by_someone_else_is_recomputed_from_observation(targets: Targets):
    """The status is the operator's report of what it observes: a foreign write to it is undone."""
    targets.create(target_manifest("told", free_port()))

    def settled() -> dict | None:  # the pod is Ready but nothing answers at its IP: a stable failure
        status = (targets.get("told") or {}).get("status") or {}
        return status if condition(status, "Ready").get("reason") == "EndpointUnreachable" else None

    honest = eventually(settled, "the unserved target reported EndpointUnreachable")
    targets.custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, targets.namespace, PLURAL, "told", {"status": {"phase": "Ready", "url": "http://x"}}
    )
    restored = eventually(
        lambda: (s := settled()) is not None and s.get("url") == honest["url"] and s,
        "the foreign status write undone",
    )
    assert restored["phase"] == honest["phase"] == "Failed"


POD_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "podmonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {"kind": "PodMonitor", "plural": "podmonitors", "singular": "podmonitor"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                },
            }
        ],
    },
}


def test_pod_monitor_follows_the_spec_where_its_crd_exists(targets: Targets, operator: OperatorProcess):
    """Only prometheus-operator's PodMonitor CRD is needed (a stand-in with its group, version and names)."""
    extensions = kubernetes.client.ApiextensionsV1Api(targets.cluster.api_client)
    extensions.create_custom_resource_definition(POD_MONITOR_CRD)
    targets.cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "crd/podmonitors.monitoring.coreos.com"
    )
    try:

        def pod_monitor() -> dict[str, Any] | None:
            try:
                return targets.custom.get_namespaced_custom_object(
                    "monitoring.coreos.com", "v1", targets.namespace, "podmonitors", "watched"
                )
            except kubernetes.client.ApiException as error:
                if error.status == 404:
                    return None
                raise

        monitoring = {"podMonitor": {"enabled": True, "labels": {"release": "prom"}}}
        targets.create(target_manifest("watched", free_port(), monitoring=monitoring))
        monitor = eventually(pod_monitor, "the PodMonitor")
        assert monitor["metadata"]["labels"]["release"] == "prom"
        assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
        # A label removed from the spec is removed from the PodMonitor (server-side apply prunes it).
        targets.patch_spec("watched", {"monitoring": {"podMonitor": {"labels": None}}})
        eventually(lambda: "release" not in pod_monitor()["metadata"]["labels"], "the label pruned")
        # A restarted operator has no memory of the PodMonitor it made, and still deletes it when disabled.
        operator.stop()
        operator.start()
        targets.patch_spec("watched", {"monitoring": {"podMonitor": {"enabled": False}}})
        eventually(lambda: pod_monitor() is None, "the PodMonitor deleted once disabled")
    finally:
        extensions.delete_custom_resource_definition(POD_MONITOR_CRD["metadata"]["name"])


def test_more_gpus_than_any_node_is_unschedulable(targets: Targets):
    targets.create(target_manifest("huge", free_port(), tensorParallelSize=16))

    def unschedulable() -> dict | None:
        status = (targets.get("huge") or {}).get("status") or {}
        return status if condition(status, "Ready").get("reason") == "Unschedulable" else None

    status = eventually(unschedulable, "Unschedulable in the Ready condition")
    assert condition(status, "Degraded")["status"] == "True"
    assert status["lastFailure"]["reason"] == "Unschedulable"
    assert "nvidia.com/gpu" in status["lastFailure"]["message"]
    assert status["phase"] == "Failed"
    warnings = eventually(
        lambda: [e for e in targets.events("huge") if e.type == "Warning"], "a Warning event"
    )
    assert any(e.reason == "Unschedulable" for e in warnings)


def test_external_endpoint_is_probed_and_published(targets: Targets, servers: ServerFarm):
    url = f"http://{servers.primary[0]}:{servers.primary[1]}"
    manifest = target_manifest("remote", 8000)
    manifest["spec"] = {"model": {"name": "tiny-llama"}, "engine": "hf", "endpoint": {"url": url}}
    targets.create(manifest)

    status = eventually(lambda: targets.ready_status("remote"), "the external target Ready")
    assert status["url"] == url
    assert status["endpoints"] == [{"address": url, "ready": True}]
    assert status["model"]["fingerprint"] == server_info(servers)["fingerprint"]
    assert targets.deployment("remote") is None and targets.service("remote") is None
    assert targets.pods("remote") == []

    dead = f"http://127.0.0.1:{free_port()}"
    generation = targets.patch_spec("remote", {"endpoint": {"url": dead}})

    def unreachable() -> dict | None:
        status = (targets.get("remote") or {}).get("status") or {}
        degraded = condition(status, "Degraded")
        fresh = status.get("observedGeneration") == generation
        return status if fresh and degraded.get("reason") == "EndpointUnreachable" else None

    status = eventually(unreachable, "the dead endpoint reported unreachable")
    assert condition(status, "Ready")["status"] == "False"
    assert status["endpoints"] == [{"address": dead, "ready": False}]
    assert "model" not in status


def test_operator_restart_mid_rollout_converges_and_delete_never_waits(
    targets: Targets, pod_serving: PodServing, operator: OperatorProcess
):
    port = free_port()
    pod_serving.ports.add(port)
    targets.create(target_manifest("phoenix", port, replicas=2))
    targets.create(target_manifest("doomed", free_port()))
    eventually(lambda: targets.ready_status("phoenix", replicas=2), "Ready before the restart")
    eventually(
        lambda: ((targets.get("doomed") or {}).get("status") or {}).get("phase"), "the other target handled"
    )
    metadata = targets.get("phoenix")["metadata"]
    assert not metadata.get("finalizers")
    assert not [key for key in metadata.get("annotations") or {} if "kopf" in key or "eagle3.dev" in key]

    # Mid-rollout: the operator has applied the new template, the pods are being replaced, and it dies.
    generation = targets.patch_spec("phoenix", {"startupTimeoutSeconds": 1200})
    eventually(
        lambda: targets.deployment("phoenix").spec.progress_deadline_seconds == 1500, "the rollout started"
    )
    operator.kill()
    try:
        # While it is down: a second spec change nobody reconciles, and a delete that must not wait for it.
        generation = targets.patch_spec("phoenix", {"startupTimeoutSeconds": 1300})
        targets.delete("doomed")
        assert targets.get("doomed") is None  # no finalizer: gone at once
        assert targets.get("phoenix")["status"]["observedGeneration"] < generation
    finally:
        operator.start()

    status = eventually(
        lambda: targets.ready_status("phoenix", generation, replicas=2), "convergence after restart"
    )
    assert targets.deployment("phoenix").spec.progress_deadline_seconds == 1600
    assert len(status["endpoints"]) == 2 and all(e["ready"] for e in status["endpoints"])

    # Deleting the target lets the garbage collector take the children.
    targets.delete("phoenix")
    eventually(
        lambda: targets.deployment("phoenix") is None and targets.service("phoenix") is None,
        "the children garbage-collected",
        timeout=120,
    )


def test_child_the_api_server_rejects_is_reported_not_retried_forever(targets: Targets):
    """A spec the CRD accepts but whose Deployment the API server refuses (an invalid label key)."""
    targets.create(target_manifest("odd", free_port(), nodeSelector={"not a label key!": "x"}))

    def rejected() -> dict | None:
        status = (targets.get("odd") or {}).get("status") or {}
        return status if condition(status, "Ready").get("reason") == "InvalidSpec" else None

    status = eventually(rejected, "the rejection reported in status")
    assert "rejected" in status["lastFailure"]["message"] and status["phase"] == "Failed"
    assert targets.deployment("odd") is None


class RecordingServer:
    """An external endpoint that answers like a target server (the farm's real /v1/info) and records every
    request's headers: what a resource author who points spec.endpoint.url at their own host would see."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.requests: list[tuple[str, dict[str, str]]] = []
        recorded, body = self.requests, json.dumps(info).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                recorded.append((self.path, dict(self.headers)))
                payload = body if self.path == "/v1/info" else b'{"status": "ready"}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_no_secret_leaves_through_a_spec(targets: Targets, servers: ServerFarm):
    """A resource author names someone else's Secret in spec.auth and points spec.endpoint.url at their own
    server: the operator probes it (and reports it Ready) without sending any credential at all."""
    secret_value = f"do-not-leak-{secrets.token_hex(8)}"
    victim = {"metadata": {"name": "victim"}, "stringData": {"token": secret_value}}
    targets.core.create_namespaced_secret(targets.namespace, victim)
    recorder = RecordingServer(server_info(servers))
    try:
        manifest = target_manifest("deputy", 8000)
        manifest["spec"] = {
            "model": {"name": "tiny-llama"},
            "engine": "hf",
            "endpoint": {"url": recorder.url},
            "auth": {"tokenSecretRef": {"name": "victim"}},
        }
        targets.create(manifest)
        status = eventually(lambda: targets.ready_status("deputy"), "the external target Ready")
        assert status["model"]["name"] == "tiny-llama"
        paths = {path for path, _ in recorder.requests}
        assert {"/readyz", "/v1/info"} <= paths
        for _, headers in recorder.requests:
            assert "authorization" not in {key.lower() for key in headers}
            assert not any(secret_value in value for value in headers.values())
    finally:
        recorder.close()


def test_token_protected_pods_are_probed_without_their_token(
    targets: Targets, auth_servers: ServerFarm, cluster: Cluster
):
    """spec.auth on managed pods: the servers want the token on the data routes, the operator never reads it
    and still sees them serve (/readyz and /v1/info are open)."""
    serving = PodServing(targets.core, targets.namespace, auth_servers)
    try:
        port = free_port()
        serving.ports.add(port)
        token = {"metadata": {"name": "target-token"}, "stringData": {"token": "not-for-the-operator"}}
        targets.core.create_namespaced_secret(targets.namespace, token)
        targets.create(target_manifest("guarded", port, auth={"tokenSecretRef": {"name": "target-token"}}))
        status = eventually(lambda: targets.ready_status("guarded", replicas=1), "Ready without the Secret")
        address = status["endpoints"][0]["address"]
        assert httpx.get(f"{address}/v1/weights/lm_head", timeout=5).status_code == 401
    finally:
        serving.close()


def _shaped(template: kubernetes.client.V1PodTemplateSpec) -> dict[str, Any]:
    """The parts of a pod template the pod settings reach."""
    pod, server = template.spec, template.spec.containers[0]
    shm = next(v for v in pod.volumes if v.name == "dshm")
    return {
        "env": [e.name for e in server.env or []],
        "volumes": [v.name for v in pod.volumes],
        "mounts": [m.mount_path for m in server.volume_mounts],
        "labels": template.metadata.labels,
        "annotations": template.metadata.annotations,
        "runtimeClassName": pod.runtime_class_name,
        "serviceAccountName": pod.service_account_name,
        "schedulerName": pod.scheduler_name,
        "spread": [c.topology_key for c in pod.topology_spread_constraints or []],
        "shm": shm.empty_dir.size_limit,
        "runAsUser": pod.security_context.run_as_user,
    }


def test_pod_settings_reach_the_pod_template_and_leave_with_the_spec(targets: Targets):
    """The RuntimeClass and ServiceAccount exist, so the pods could be admitted as rendered."""
    node = kubernetes.client.NodeV1Api(targets.cluster.api_client)
    node.create_runtime_class({"metadata": {"name": "e3t-test-runtime"}, "handler": "nvidia"})
    try:
        _shape_and_unshape(targets)
    finally:
        node.delete_runtime_class("e3t-test-runtime")


def _shape_and_unshape(targets: Targets) -> None:
    targets.core.create_namespaced_service_account(targets.namespace, {"metadata": {"name": "bucket-reader"}})
    targets.create(target_manifest("shaped", free_port(), **POD_SETTINGS))

    deployment = eventually(lambda: targets.deployment("shaped"), "the Deployment")
    shaped = _shaped(deployment.spec.template)
    assert shaped["env"] == ["HF_HUB_OFFLINE", "NCCL_DEBUG", "POD"]
    assert shaped["volumes"] == ["model", "dshm", "compile-cache"]
    assert "/cache" in shaped["mounts"]
    assert shaped["labels"]["kueue.x-k8s.io/queue-name"] == "gpus"
    assert shaped["labels"]["app.kubernetes.io/instance"] == "shaped"
    assert shaped["annotations"]["team"] == "ml"
    assert (shaped["runtimeClassName"], shaped["serviceAccountName"]) == ("e3t-test-runtime", "bucket-reader")
    assert shaped["schedulerName"] == "gang-scheduler"
    assert shaped["spread"] == ["kubernetes.io/hostname"]
    assert shaped["shm"] == "32Gi"
    assert shaped["runAsUser"] is None
    rolling = deployment.spec.strategy.rolling_update
    assert (rolling.max_surge, rolling.max_unavailable) == (1, 0)

    targets.patch_spec("shaped", dict.fromkeys(POD_SETTINGS))  # a merge patch of nulls deletes the fields

    def plain() -> dict[str, Any] | None:
        template = targets.deployment("shaped").spec.template
        return _shaped(template) if "kueue.x-k8s.io/queue-name" not in template.metadata.labels else None

    shaped = eventually(plain, "the pod settings gone from the template")
    assert shaped["env"] == ["HF_HUB_OFFLINE"]
    assert shaped["volumes"] == ["model", "dshm"]
    assert "/cache" not in shaped["mounts"]
    assert "team" not in shaped["annotations"]
    assert (shaped["runtimeClassName"], shaped["serviceAccountName"]) == (None, None)
    assert shaped["schedulerName"] == "default-scheduler"
    assert shaped["spread"] == []
    assert shaped["shm"] == "16Gi"
    assert shaped["runAsUser"] == 10001
    rolling = targets.deployment("shaped").spec.strategy.rolling_update
    assert (rolling.max_surge, rolling.max_unavailable) == (0, 1)


def test_network_policy_is_accepted_selects_the_targets_pods_and_goes_when_disabled(targets: Targets):
    networking = kubernetes.client.NetworkingV1Api(targets.cluster.api_client)

    def policy() -> kubernetes.client.V1NetworkPolicy | None:
        found = networking.list_namespaced_network_policy(targets.namespace).items
        return found[0] if found else None

    isolation = {"enabled": True, "allowedNamespaces": ["trainers"]}
    targets.create(target_manifest("fenced", free_port(), replicas=2, networkPolicy=isolation))
    targets.create(target_manifest("neighbour", free_port()))
    created = eventually(policy, "the NetworkPolicy")
    assert created.metadata.name == "fenced"
    assert created.metadata.owner_references[0].name == "fenced"
    eventually(lambda: len(targets.pods("fenced")) == 2 and targets.pods("neighbour"), "both targets' pods")
    selector = ",".join(f"{k}={v}" for k, v in created.spec.pod_selector.match_labels.items())
    selected = targets.core.list_namespaced_pod(targets.namespace, label_selector=selector).items
    assert sorted(p.metadata.name for p in selected) == sorted(
        p.metadata.name for p in targets.pods("fenced")
    )
    (data,) = (
        created.spec.ingress
    )  # this operator runs outside the cluster: no namespace of its own, no Prometheus
    assert [port.port for port in data.ports] == ["http"]
    (peer,) = data._from
    assert peer.namespace_selector.match_expressions[0].values == ["trainers"]

    targets.patch_spec("fenced", {"networkPolicy": {"enabled": False}})
    eventually(lambda: policy() is None, "the NetworkPolicy deleted once disabled")


def hub_target(name: str, claim: str, **spec: Any) -> dict[str, Any]:
    manifest = target_manifest(name, free_port(), **spec)
    manifest["spec"]["model"]["source"] = {"huggingFace": {"repo": "org/tiny-llama", "cacheClaimName": claim}}
    return manifest


def hydration_jobs(targets: Targets) -> list[kubernetes.client.V1Job]:
    return (
        kubernetes.client.BatchV1Api(targets.cluster.api_client).list_namespaced_job(targets.namespace).items
    )


def hydration_pods(targets: Targets) -> list[kubernetes.client.V1Pod]:
    selector = "app.kubernetes.io/component=model-hydration"
    return targets.core.list_namespaced_pod(targets.namespace, label_selector=selector).items


def bind_claim(targets: Targets, claim: str) -> str:
    """A claim bound to a hostPath volume made for it (this cluster has no provisioner); returns the volume's
    name, for the caller to delete (it goes once the namespace's claim has gone)."""
    volume = f"{targets.namespace}-{claim}"
    targets.core.create_persistent_volume(
        {
            "metadata": {"name": volume},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteMany"],
                "hostPath": {"path": f"/tmp/{volume}"},
                "storageClassName": "",
                "persistentVolumeReclaimPolicy": "Retain",
            },
        }
    )
    targets.core.create_namespaced_persistent_volume_claim(
        targets.namespace,
        {
            "metadata": {"name": claim},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "resources": {"requests": {"storage": "1Gi"}},
                "storageClassName": "",
                "volumeName": volume,
            },
        },
    )
    return volume


def test_one_hydration_job_serves_three_replicas_which_wait_for_it(targets: Targets):
    targets.create(hub_target("hydrated", "hf-cache", replicas=3))
    (job,) = eventually(lambda: hydration_jobs(targets), "the hydration Job")
    assert job.metadata.owner_references[0].name == "hydrated"

    # The claim does not exist yet, so the download cannot start: no server pod is asked for meanwhile,
    # and the target says why.
    def stuck() -> dict | None:
        status = (targets.get("hydrated") or {}).get("status") or {}
        return status if condition(status, "Ready").get("reason") == "Unschedulable" else None

    status = eventually(stuck, "the unschedulable download reported")
    assert "hydration pod" in condition(status, "Ready")["message"]
    assert "hf-cache" in condition(status, "Ready")["message"]
    assert targets.deployment("hydrated").spec.replicas == 0 and targets.pods("hydrated") == []

    volume = bind_claim(targets, "hf-cache")  # kwok runs the download pod, which then completes
    try:
        eventually(
            lambda: len(targets.pods("hydrated")) == 3, "three server pods once the download completed"
        )
    finally:
        targets.core.delete_persistent_volume(volume)
    (job,) = hydration_jobs(targets)
    assert job.status.succeeded == 1
    assert len(hydration_pods(targets)) == 1  # one download for three replicas
    for pod in targets.pods("hydrated"):
        (wait,) = pod.spec.init_containers
        assert wait.name == "wait-for-model" and wait.command[:2] == ["eagle3-target", "wait-for-model"]
    assert targets.deployment("hydrated").spec.replicas == 3


def test_a_download_that_cannot_succeed_fails_the_target_with_its_reason(targets: Targets):
    """The download pod stays unscheduled (no claim), so the test plays its kubelet: it ends the pod the way
    `eagle3-target hydrate` ends on a gated repository (exit 2, the reason as termination message)."""
    targets.create(hub_target("gated", "missing-cache", replicas=2))
    (pod,) = eventually(lambda: hydration_pods(targets), "the download pod")
    reason = "org/tiny-llama@main: gated repository; the token may not read it: 401 Client Error"
    terminated = {"exitCode": 2, "reason": "Error", "message": reason, "startedAt": None, "finishedAt": None}
    status = {
        "phase": "Failed",
        "containerStatuses": [
            {
                "name": "download-model",
                "image": pod.spec.containers[0].image,
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "state": {"terminated": {k: v for k, v in terminated.items() if v is not None}},
            }
        ],
    }
    targets.core.patch_namespaced_pod_status(
        pod.metadata.name, targets.namespace, [{"op": "replace", "path": "/status", "value": status}]
    )

    def failed() -> dict | None:
        status = (targets.get("gated") or {}).get("status") or {}
        return status if condition(status, "Ready").get("reason") == "ModelDownloadFailed" else None

    status = eventually(failed, "the failed download reported")
    assert reason in condition(status, "Degraded")["message"]
    assert status["lastFailure"]["reason"] == "ModelDownloadFailed" and status["phase"] == "Failed"
    (job,) = hydration_jobs(targets)
    assert any(c.type == "Failed" and c.status == "True" for c in job.status.conditions)
    assert len(hydration_pods(targets)) == 1  # exit 2 is not retried
    assert targets.deployment("gated").spec.replicas == 0 and targets.pods("gated") == []


def test_a_new_download_leaves_the_previous_one_serving_until_it_completes(targets: Targets):
    """Moving to another cache claim (or revision) is a new download; the Deployment keeps its template and
    pods until that download completes."""
    volumes = [bind_claim(targets, "cache-a")]
    try:
        targets.create(hub_target("moving", "cache-a", replicas=2))
        serving = eventually(lambda: len(pods := targets.pods("moving")) == 2 and pods, "two pods on cache-a")

        def claim() -> str:
            template = targets.deployment("moving").spec.template.spec
            return next(v for v in template.volumes if v.name == "model").persistent_volume_claim.claim_name

        (first_job,) = hydration_jobs(targets)
        source = {"huggingFace": {"repo": "org/tiny-llama", "cacheClaimName": "cache-b"}}
        targets.patch_spec("moving", {"model": {"source": source}})
        eventually(
            lambda: [j.metadata.name for j in hydration_jobs(targets)] not in ([], [first_job.metadata.name]),
            "the new download's Job",
        )

        def held() -> dict | None:  # cache-b does not exist yet: its download cannot run
            status = (targets.get("moving") or {}).get("status") or {}
            return status if condition(status, "Ready").get("reason") == "Unschedulable" else None

        eventually(held, "the new download reported stuck")
        assert claim() == "cache-a" and targets.deployment("moving").spec.replicas == 2
        assert sorted(p.metadata.name for p in targets.pods("moving")) == sorted(
            p.metadata.name for p in serving
        )

        volumes.append(bind_claim(targets, "cache-b"))
        eventually(
            lambda: claim() == "cache-b", "the Deployment moved to cache-b once its download completed"
        )
    finally:
        for volume in volumes:
            targets.core.delete_persistent_volume(volume)
