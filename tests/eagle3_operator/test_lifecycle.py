"""A managed target's life against the real control plane: Ready, idle, scaled, rolled out, suspended,
an operator killed mid-rollout, deleted without waiting, a restart its users never see; and an external
endpoint probed and published, its model replaced whole when the server behind it changes, also among a
hundred external endpoints that trickle their answers.

One operator process serves the whole module (only this module's namespaces); each test has its own.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from eagle3_operator.probe import NO_TARGET_SERVER, PROBE_DEADLINE_S
from eagle3_target.protocol import GROUP, PLURAL, VERSION

from support.cluster import nodes
from support.cluster.access import Cluster
from support.cluster.waiting import eventually, free_port
from support.hostile_endpoints import TRICKLE, HostileEndpoint
from support.operator_process import OperatorProcess
from support.server_farm import PodServing, ServerFarm
from support.server_process import start_on_port
from support.targets import Targets, condition, target_manifest

pytestmark = pytest.mark.usefixtures("operator")


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
        status = targets.status("llama")
        endpoints = status.get("endpoints") or []
        return status if endpoints and not endpoints[0]["ready"] else None

    status = eventually(unserved_endpoint, "an endpoint published as not ready")
    assert condition(status, "Ready")["status"] == "False"
    assert status["endpoints"][0]["address"].startswith(f"http://127.{nodes.POD_NET}.")

    # A real server answers at the pod's IP:port → Ready, with endpoint, model and fingerprint.
    pod_serving.ports.add(port)
    status = eventually(lambda: targets.ready_status("llama", replicas=1), "Ready with one endpoint")
    info = servers.info()
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
        status = targets.status("llama")
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


def test_operator_restart_mid_rollout_converges_and_delete_never_waits(
    targets: Targets, pod_serving: PodServing, operator: OperatorProcess
):
    port = free_port()
    pod_serving.ports.add(port)
    targets.create(target_manifest("phoenix", port, replicas=2))
    targets.create(target_manifest("doomed", free_port()))
    eventually(lambda: targets.ready_status("phoenix", replicas=2), "Ready before the restart")
    eventually(lambda: targets.status("doomed").get("phase"), "the other target handled")
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


def test_an_operator_restart_changes_nothing_a_user_sees(
    targets: Targets, pod_serving: PodServing, operator: OperatorProcess
):
    """Killed and started again, the operator finds every endpoint not probed yet: unknown, not failed. The
    stored status stands (sampled every 300 ms: Ready and Available never False, the model and endpoints
    kept) and, once the probes answer, nothing is written and no event posted."""
    port = free_port()
    pod_serving.ports.add(port)
    targets.create(target_manifest("steady", port, replicas=2))
    eventually(lambda: targets.ready_status("steady", replicas=2), "Ready before the restart")
    eventually(lambda: operator.metric_total("eagle3_operator_status_writes_total") >= 1, "a status write")
    time.sleep(2)  # let the last writes and events of the start-up settle
    before = targets.get("steady")
    events = [(e.reason, e.count) for e in targets.events("steady")]

    operator.kill()
    operator.start()
    samples: list[dict[str, Any]] = []
    settled = time.monotonic() + 15  # the first verdicts, and a few probe periods after them
    while time.monotonic() < settled:
        samples.append(targets.get("steady")["status"])
        time.sleep(0.3)

    assert samples
    for status in samples:
        assert condition(status, "Ready")["status"] == "True", status
        assert condition(status, "Available")["status"] == "True", status
        assert status.get("model") == before["status"]["model"]
    after = targets.get("steady")
    assert after["status"] == before["status"]  # lastTransitionTime included
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]  # no write at all
    assert [(e.reason, e.count) for e in targets.events("steady")] == events
    assert operator.metric_total("eagle3_operator_status_writes_total") == 0  # this process wrote nothing


def test_external_endpoint_is_probed_and_published(targets: Targets, servers: ServerFarm):
    url = f"http://{servers.primary[0]}:{servers.primary[1]}"
    manifest = target_manifest("remote", 8000)
    manifest["spec"] = {"model": {"name": "tiny-llama"}, "engine": "hf", "endpoint": {"url": url}}
    targets.create(manifest)

    status = eventually(lambda: targets.ready_status("remote"), "the external target Ready")
    assert status["url"] == url
    assert status["endpoints"] == [{"address": url, "ready": True}]
    assert status["model"]["fingerprint"] == servers.info()["fingerprint"]
    assert targets.deployment("remote") is None and targets.service("remote") is None
    assert targets.pods("remote") == []

    dead = f"http://127.0.0.1:{free_port()}"
    generation = targets.patch_spec("remote", {"endpoint": {"url": dead}})

    def unreachable() -> dict | None:
        status = targets.status("remote")
        degraded = condition(status, "Degraded")
        fresh = status.get("observedGeneration") == generation
        return status if fresh and degraded.get("reason") == "EndpointUnreachable" else None

    status = eventually(unreachable, "the dead endpoint reported unreachable")
    assert condition(status, "Ready")["status"] == "False"
    assert status["endpoints"] == [{"address": dead, "ready": False}]
    assert "model" not in status


def external_target(name: str, url: str) -> dict[str, Any]:
    manifest = target_manifest(name, 8000)
    manifest["spec"] = {"model": {"name": "tiny-llama"}, "engine": "hf", "endpoint": {"url": url}}
    return manifest


def test_a_restarted_external_server_replaces_the_model_in_status_whole(
    targets: Targets, tiny_llama_dir: Path, tmp_path: Path
):
    """Review round 3, B5: status was a merge patch of changed keys, so a server restarted without
    --revision left the old revision in status.model beside the new fingerprint."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["--model", str(tiny_llama_dir), "--engine", "hf", "--dtype", "float32"]
    first = start_on_port(tmp_path, port, [*args, "--revision", "abc123"])
    try:
        first.wait_until("/readyz", 200)
        targets.create(external_target("moved", url))
        eventually(
            lambda: model_of(targets, "moved").get("revision") == "abc123", "the first model in status"
        )
    finally:
        first.stop()
    second = start_on_port(tmp_path, port, args)
    try:
        second.wait_until("/readyz", 200)
        served = httpx.get(f"{url}/v1/info").json()
        assert served.get("revision") is None
        model = eventually(
            lambda: (m := model_of(targets, "moved")).get("fingerprint") == served["fingerprint"] and m,
            "the restarted server's model in status",
            timeout=60,
        )
        assert "revision" not in model, model
    finally:
        second.stop()


def model_of(targets: Targets, name: str) -> dict[str, Any]:
    return targets.status(name).get("model") or {}


def test_a_hundred_trickling_external_endpoints_leave_a_new_target_ready_at_once(
    targets: Targets, servers: ServerFarm
):
    """Anyone who may create a target can point it at an endpoint that answers a byte a second. A hundred
    of them cost their own targets only: each reads "no target server answers there", and a healthy
    target created among them is Ready well before one probe deadline (it never waits behind them)."""
    with HostileEndpoint(TRICKLE, pause=1.0) as trickling:
        names = [f"trickle-{i}" for i in range(100)]
        for i, name in enumerate(names):
            targets.create(external_target(name, f"{trickling}/{i}"))

        def all_stalled() -> bool:
            listed = targets.custom.list_namespaced_custom_object(GROUP, VERSION, targets.namespace, PLURAL)
            messages = [condition(t.get("status") or {}, "Ready").get("message", "") for t in listed["items"]]
            return len(messages) == len(names) and all(NO_TARGET_SERVER in m for m in messages)

        eventually(all_stalled, "every trickling target's verdict", timeout=120)
        created = time.monotonic()
        targets.create(external_target("healthy", f"http://{servers.primary[0]}:{servers.primary[1]}"))
        eventually(lambda: targets.ready_status("healthy"), "the healthy target Ready")
        assert time.monotonic() - created < PROBE_DEADLINE_S
        assert NO_TARGET_SERVER in condition(targets.get("trickle-0")["status"], "Degraded")["message"]
