"""Day-2 situations on the real control plane: fields removed from a spec, finished pods, refused writes,
names taken by others, scale-ups that keep serving, and `kubectl rollout restart` next to the operator.

One operator process serves the module (only this module's namespaces); each test has its own namespace.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import kubernetes
import pytest
from eagle3_target.client import ResolveTimeout, resolve

from support.cluster.waiting import eventually, free_port
from support.operator_process import OperatorProcess
from support.server_farm import PodServing
from support.targets import Targets, condition, target_manifest

pytestmark = pytest.mark.usefixtures("operator")

TOUCHED = {
    "nodeSelector": {"type": "kwok"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
    "affinity": {"podAntiAffinity": {}},
    "priorityClassName": "day2-high",
    "imagePullSecrets": [{"name": "registry"}],
    "resources": {"requests": {"cpu": "2", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
}


def test_removed_spec_fields_are_removed_from_the_deployment(targets: Targets, cluster):
    scheduling = kubernetes.client.SchedulingV1Api(cluster.api_client)
    scheduling.create_priority_class({"metadata": {"name": "day2-high"}, "value": 1000})
    try:
        targets.create(target_manifest("trim", free_port(), **TOUCHED))

        def deployed() -> Any:
            d = targets.deployment("trim")
            return d if d is not None and d.spec.template.spec.priority_class_name == "day2-high" else None

        pod = eventually(deployed, "the Deployment with every field").spec.template.spec
        assert pod.node_selector == {"type": "kwok"} and pod.tolerations and pod.affinity
        assert pod.image_pull_secrets and pod.containers[0].resources.limits["nvidia.com/gpu"] == "1"

        # A merge patch with nulls deletes the fields (what editing them out of a manifest and applying does).
        removed = {key: None for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName")}
        removed |= {"imagePullSecrets": None, "tensorParallelSize": 0}
        removed["resources"] = {"requests": {"cpu": None}, "limits": {"memory": None}}
        generation = targets.patch_spec("trim", removed)

        def trimmed() -> Any:
            d = targets.deployment("trim")
            spec = d.spec.template.spec
            gone = (spec.node_selector, spec.tolerations, spec.affinity, spec.priority_class_name)
            return d if not any(gone) and not spec.image_pull_secrets else None

        pod = eventually(trimmed, "the removed fields pruned from the Deployment").spec.template.spec
        resources = pod.containers[0].resources
        # No GPU, no CPU request, no memory limit; the scratch space keeps its default bounds.
        assert {k: v for k, v in resources.requests.items() if k != "ephemeral-storage"} == {"memory": "1Gi"}
        assert set(resources.limits or {}) == {"ephemeral-storage"}
        status = eventually(
            lambda: (s := targets.get("trim")["status"]).get("observedGeneration") == generation and s,
            "the change observed",
        )
        assert status["observedGeneration"] == generation
    finally:
        scheduling.delete_priority_class("day2-high")


def test_rollout_restart_survives_the_operator_and_drift_is_still_repaired(
    targets: Targets, pod_serving: PodServing, cluster
):
    port = free_port()
    pod_serving.ports.add(port)
    targets.create(target_manifest("kept", port))
    eventually(lambda: targets.ready_status("kept", replicas=1), "Ready")
    first_pod = targets.pods("kept")[0].metadata.name

    cluster.kubectl("rollout", "restart", "-n", targets.namespace, "deployment/kept")
    restarted = eventually(
        lambda: first_pod not in {p.metadata.name for p in targets.pods("kept")}, "the restart's new pod"
    )
    assert restarted
    # A spec change makes the operator apply the Deployment again: the restart annotation (owned by
    # kubectl) stays, so the change does not undo the restart.
    generation = targets.patch_spec("kept", {"startupTimeoutSeconds": 700})
    eventually(lambda: targets.ready_status("kept", generation, replicas=1), "Ready after the change")
    template = targets.deployment("kept").spec.template.metadata.annotations
    assert "kubectl.kubernetes.io/restartedAt" in template

    # Someone else's edit of a field the operator renders is still repaired.
    targets.apps.patch_namespaced_deployment(
        "kept", targets.namespace, {"spec": {"progressDeadlineSeconds": 42}}
    )
    eventually(lambda: targets.deployment("kept").spec.progress_deadline_seconds == 1000, "drift repaired")


def test_finished_pods_are_neither_endpoints_nor_held_against_ready(
    targets: Targets, pod_serving: PodServing
):
    """An evicted pod stays behind in phase Failed (no deletionTimestamp) while its replacement serves."""
    port = free_port()
    pod_serving.ports.add(port)
    targets.create(target_manifest("evicted", port))
    eventually(lambda: targets.ready_status("evicted", replicas=1), "Ready")
    (pod,) = targets.pods("evicted")
    eviction = {
        "status": {
            "phase": "Failed",
            "reason": "Evicted",
            "message": "The node was low on resource: memory.",
            "conditions": [{"type": "Ready", "status": "False", "reason": "PodFailed"}],
        }
    }
    targets.core.patch_namespaced_pod_status(pod.metadata.name, targets.namespace, eviction)

    def served_by_replacement() -> dict | None:
        status = targets.ready_status("evicted", replicas=1)
        if status is None or [e["pod"] for e in status["endpoints"]] == [pod.metadata.name]:
            return None
        return status

    status = eventually(served_by_replacement, "Ready on the replacement pod")
    assert pod.metadata.name not in {e["pod"] for e in status["endpoints"]}
    assert status["phase"] == "Ready" and condition(status, "Degraded")["status"] == "False"
    left = targets.core.read_namespaced_pod(pod.metadata.name, targets.namespace)
    assert left.status.phase == "Failed"  # still there: ignored, not deleted
    time.sleep(3)  # and it never turns the target Degraded later (the operator re-probes every second)
    assert targets.ready_status("evicted", replicas=1) is not None


def attempts_seen(operator: OperatorProcess, line: str, count: int, timeout: float) -> list[float]:
    """When (monotonic) each of the operator's first `count` log lines containing `line` appeared."""
    seen: list[float] = []
    deadline = time.monotonic() + timeout
    while len(seen) < count and time.monotonic() < deadline:
        seen += [time.monotonic()] * (operator.log().count(line) - len(seen))
        time.sleep(0.05)
    return seen


def test_refused_writes_are_reported_with_reason_message_and_one_event(
    targets: Targets, cluster, operator: OperatorProcess
):
    """A ResourceQuota (403 'exceeded quota') and an admission policy (422 'denied request') each become a
    condition with the API server's words and one Warning event; a refused apply is tried again when its
    backoff is over, not before and not never; once lifted, the target converges."""
    quota = {
        "metadata": {"name": "no-deployments"},
        "spec": {"hard": {"count/deployments.apps": "0"}},
    }
    targets.core.create_namespaced_resource_quota(targets.namespace, quota)
    eventually(
        lambda: targets.core.read_namespaced_resource_quota("no-deployments", targets.namespace).status.hard,
        "the quota's status",
    )
    targets.create(target_manifest("quota", free_port()))
    refused = f"{targets.namespace}/quota: the API server rejected a child (HTTP 403)"
    attempts = attempts_seen(operator, refused, 3, timeout=30)
    assert len(attempts) == 3, operator.log()[-2000:]
    # Backoff 1 s, then 2 s (the log line says which wait comes next); a lost retry would never come.
    assert "trying again in 1s" in operator.log() and "trying again in 2s" in operator.log()
    for (earlier, later), wait in zip(itertools.pairwise(attempts), (1, 2), strict=True):
        gap = later - earlier
        assert wait - 0.2 <= gap <= wait + 3, (attempts, wait)
    status = eventually(
        lambda: targets.status_with_reason("quota", "QuotaExceeded"), "QuotaExceeded in status"
    )
    assert "exceeded quota" in condition(status, "Ready")["message"]
    assert (condition(status, "Degraded")["status"], status["phase"]) == ("True", "Failed")
    assert status["lastFailure"]["reason"] == "QuotaExceeded"
    time.sleep(4)  # several retries later: still one event, not one per attempt
    events = [e for e in targets.events("quota") if e.reason == "QuotaExceeded"]
    assert len(events) == 1 and events[0].type == "Warning" and events[0].count == 1
    targets.core.delete_namespaced_resource_quota("no-deployments", targets.namespace)
    eventually(lambda: targets.deployment("quota"), "the Deployment once the quota is gone", timeout=120)

    admission = kubernetes.client.AdmissionregistrationV1Api(cluster.api_client)
    policy_name = f"no-services-{targets.namespace}"
    admission.create_validating_admission_policy(
        {
            "metadata": {"name": policy_name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE", "UPDATE"],
                            "resources": ["services"],
                        }
                    ]
                },
                "validations": [{"expression": "false", "message": "services need a ticket here"}],
            },
        }
    )
    try:
        admission.create_validating_admission_policy_binding(
            {
                "metadata": {"name": policy_name},
                "spec": {
                    "policyName": policy_name,
                    "validationActions": ["Deny"],
                    "matchResources": {
                        "namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": targets.namespace}
                        }
                    },
                },
            }
        )
        eventually(lambda: service_refused(targets), "the admission policy in force")
        targets.create(target_manifest("policed", free_port()))
        status = eventually(
            lambda: targets.status_with_reason("policed", "AdmissionDenied"), "AdmissionDenied in status"
        )
        assert "services need a ticket here" in condition(status, "Ready")["message"]
    finally:
        admission.delete_validating_admission_policy_binding(policy_name)
        admission.delete_validating_admission_policy(policy_name)
    eventually(lambda: targets.service("policed"), "the Service once the policy is gone", timeout=120)


def service_refused(targets: Targets) -> bool:
    probe = {"metadata": {"name": "probe"}, "spec": {"ports": [{"port": 80}]}}
    try:
        targets.core.create_namespaced_service(targets.namespace, probe, dry_run="All")
    except kubernetes.client.ApiException as error:
        return "denied request" in error.body  # a policy's denial answers 422 unless it names a reason
    return False


def test_a_name_taken_by_someone_else_is_never_taken_over(targets: Targets):
    foreign = {
        "metadata": {"name": "taken", "labels": {"team": "web"}},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]},
    }
    targets.core.create_namespaced_service(targets.namespace, foreign)
    targets.create(target_manifest("taken", free_port()))
    status = eventually(lambda: targets.status_with_reason("taken", "NameConflict"), "NameConflict in status")
    message = condition(status, "Ready")["message"]
    assert f"Service {targets.namespace}/taken" in message and "not owned" in message
    service = targets.service("taken")
    assert service.spec.selector == {"app": "web"} and not service.metadata.owner_references
    assert any(e.reason == "NameConflict" and e.type == "Warning" for e in targets.events("taken"))

    targets.core.delete_namespaced_service("taken", targets.namespace)
    owned = eventually(
        lambda: (s := targets.service("taken")) is not None and s.metadata.owner_references and s,
        "the target's own Service once the name is free",
        timeout=120,
    )
    assert owned.metadata.owner_references[0].kind == "Eagle3Target"

    # Someone replaces the target's own Service with theirs (no owner reference): an object this process
    # applied before is not thereby its own; it is left alone and reported, never taken back.
    replaced = targets.core.read_namespaced_service("taken", targets.namespace)
    replaced.metadata.owner_references = None
    replaced.metadata.labels = {"team": "web"}
    targets.core.replace_namespaced_service("taken", targets.namespace, replaced)
    eventually(
        lambda: targets.status_with_reason("taken", "NameConflict"), "NameConflict for the replaced Service"
    )
    time.sleep(2)  # retries come and go: still theirs
    service = targets.service("taken")
    assert not service.metadata.owner_references and service.metadata.labels == {"team": "web"}


def test_scale_up_keeps_the_target_available_and_restarts_no_pod(targets: Targets, pod_serving: PodServing):
    """Eight GPUs per pod on two 8-GPU nodes: the third replica cannot be scheduled. Ready (all desired
    replicas) goes False; Available stays True, resolve() returns the serving endpoints at once, and only
    resolve(require="Ready") waits. The first pod is never restarted."""
    port = free_port()
    pod_serving.ports.add(port)
    targets.create(target_manifest("wide", port, tensorParallelSize=8))
    eventually(lambda: targets.ready_status("wide", replicas=1), "Ready with one replica")
    (first,) = targets.pods("wide")

    generation = targets.patch_spec("wide", {"replicas": 3})

    def two_serving() -> dict | None:
        status = targets.status("wide")
        fresh = condition(status, "Available").get("observedGeneration") == generation
        return status if fresh and status.get("readyReplicas") == 2 else None

    status = eventually(two_serving, "two replicas serving, the third unschedulable")
    assert condition(status, "Ready")["status"] == "False"
    assert condition(status, "Ready")["reason"] == "Unschedulable"
    assert (condition(status, "Available")["status"], condition(status, "Available")["reason"]) == (
        "True",
        "Serving",
    )
    assert first.metadata.uid in {p.metadata.uid for p in targets.pods("wide")}

    api_client = targets.cluster.api_client
    found = resolve("wide", targets.namespace, wait=0, api_client=api_client)
    assert len(found.endpoints) == 2 and found.model.fingerprint == status["model"]["fingerprint"]
    with pytest.raises(ResolveTimeout, match="Unschedulable"):
        resolve("wide", targets.namespace, wait=1, api_client=api_client, require="Ready")
