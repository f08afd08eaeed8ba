"""A Hugging Face source against the real control plane: one download Job for all replicas, which wait
for it; a download that cannot succeed fails the target with its reason; a new download leaves the
previous one serving until it completes.

One operator process serves the whole module (only this module's namespaces); each test has its own.
"""

from __future__ import annotations

from typing import Any

import kubernetes
import pytest

from support.cluster.waiting import eventually, free_port
from support.targets import Targets, condition, target_manifest

pytestmark = pytest.mark.usefixtures("operator")


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
