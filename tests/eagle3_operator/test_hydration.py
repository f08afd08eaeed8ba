"""A Hugging Face source against the real control plane: one download Job for all replicas, which wait
for it; a download that cannot succeed fails the target with its reason; a running download's progress
moves in status; a new download leaves the previous one serving until it completes; a mirror and
resources reach the download without a new download.

One operator process serves the whole module (only this module's namespaces); each test has its own.
"""

from __future__ import annotations

import contextlib
import ipaddress
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kubernetes
import pytest
from eagle3_operator.constants import HYDRATION_PROGRESS_PORT
from eagle3_target.protocol import HydrationProgress

from support.cluster import nodes
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
    status = eventually(
        lambda: targets.status_with_reason("hydrated", "Unschedulable"), "the unschedulable download reported"
    )
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

    status = eventually(
        lambda: targets.status_with_reason("gated", "ModelDownloadFailed"), "the failed download reported"
    )
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

        # cache-b does not exist yet: its download cannot run
        eventually(
            lambda: targets.status_with_reason("moving", "Unschedulable"), "the new download reported stuck"
        )
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


def test_a_mirror_and_resources_reach_the_download_without_a_new_download(targets: Targets):
    """The source's env (a mirror, a proxy) and resources are how the download runs, not what it downloads:
    they follow the operator's own env and keep the Job's name. A Job that has not completed is replaced to
    take a change; a completed one stands, and the target keeps serving."""
    mirror = [
        {"name": "HF_ENDPOINT", "value": "http://hub-mirror.example"},
        {"name": "NO_PROXY", "value": ".svc"},
    ]
    resources = {"requests": {"cpu": "500m", "memory": "2Gi"}, "limits": {"memory": "8Gi"}}
    manifest = hub_target("mirrored", "mirror-cache")
    manifest["spec"]["model"]["source"]["huggingFace"] |= {"env": mirror, "resources": resources}
    targets.create(manifest)
    (job,) = eventually(lambda: hydration_jobs(targets), "the hydration Job")
    (container,) = job.spec.template.spec.containers
    names = [var.name for var in container.env]
    assert names[-2:] == ["HF_ENDPOINT", "NO_PROXY"] and "HF_HOME" in names[:-2]
    assert container.env[-2].value == "http://hub-mirror.example"
    assert container.resources.requests == {"cpu": "500m", "memory": "2Gi", "ephemeral-storage": "256Mi"}
    assert container.resources.limits == {"memory": "8Gi", "ephemeral-storage": "2Gi"}
    eventually(lambda: targets.status_with_reason("mirrored", "Unschedulable"), "the stuck download reported")

    # Not completed (no claim yet): the Job is replaced under the same name to take the new mirror, once
    # its pod has gone (a pod held here by a finalizer stands for one still writing into the cache).
    (old_pod,) = eventually(lambda: hydration_pods(targets), "the stuck download's pod")
    hold = [{"op": "add", "path": "/metadata/finalizers", "value": ["eagle3.dev/test-hold"]}]
    targets.core.patch_namespaced_pod(old_pod.metadata.name, targets.namespace, hold)
    mirror[0]["value"] = "http://other-mirror.example"
    source = {"huggingFace": {"repo": "org/tiny-llama", "cacheClaimName": "mirror-cache", "env": mirror}}
    targets.patch_spec("mirrored", {"model": {"source": source}})

    def being_deleted() -> kubernetes.client.V1Job | None:
        (held,) = hydration_jobs(targets)
        return held if held.metadata.deletion_timestamp else None

    held = eventually(being_deleted, "the stuck download's Job being deleted")
    assert held.metadata.uid == job.metadata.uid and "foregroundDeletion" in held.metadata.finalizers
    # Foreground: its pod goes first, and the Job stays while the pod does, so no new one is made beside it.
    pod = targets.core.read_namespaced_pod
    eventually(
        lambda: pod(old_pod.metadata.name, targets.namespace).metadata.deletion_timestamp, "pod deleted"
    )
    assert [j.metadata.uid for j in hydration_jobs(targets)] == [job.metadata.uid]
    release = [{"op": "remove", "path": "/metadata/finalizers"}]
    targets.core.patch_namespaced_pod(old_pod.metadata.name, targets.namespace, release)

    def replaced() -> kubernetes.client.V1Job | None:
        jobs = [j for j in hydration_jobs(targets) if j.metadata.uid != job.metadata.uid]
        return jobs[0] if jobs else None

    new_job = eventually(replaced, "the stuck download's Job replaced once its pod had gone")
    assert new_job.metadata.name == job.metadata.name
    assert old_pod.metadata.uid not in {pod.metadata.uid for pod in hydration_pods(targets)}
    assert new_job.spec.template.spec.containers[0].env[-2].value == "http://other-mirror.example"

    volume = bind_claim(targets, "mirror-cache")
    try:
        eventually(lambda: targets.pods("mirrored"), "a server pod once the download completed")
        (completed,) = eventually(lambda: [j for j in hydration_jobs(targets) if j.status.succeeded], "done")
        # Completed: a new mirror is no new download; the Job and the serving Deployment stand.
        mirror[0]["value"] = "http://third-mirror.example"
        generation = targets.patch_spec("mirrored", {"model": {"source": source}})
        eventually(
            lambda: targets.status("mirrored").get("observedGeneration") == generation, "the change seen"
        )
        assert [j.metadata.uid for j in hydration_jobs(targets)] == [completed.metadata.uid]
        assert condition(targets.status("mirrored"), "Ready")["reason"] != "Downloading"
        assert targets.deployment("mirrored").spec.replicas == 1
    finally:
        targets.core.delete_persistent_volume(volume)


@contextlib.contextmanager
def progress_endpoint(ip: str, files_total: int) -> Iterator[list[int]]:
    """Answers at ip:HYDRATION_PROGRESS_PORT as a running `eagle3-target hydrate` does, one more file done
    at each answer; yields the list of files done it answered with."""
    answered: list[int] = []

    class Progress(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            answered.append(min(len(answered) + 1, files_total))
            done = answered[-1]
            body = HydrationProgress(
                files_done=done,
                files_total=files_total,
                bytes_done=done * 10**9,
                bytes_total=files_total * 10**9,
            ).model_dump_json(by_alias=True)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer((ip, HYDRATION_PROGRESS_PORT), Progress)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield answered
    finally:
        server.shutdown()
        server.server_close()


def test_a_running_downloads_progress_moves_in_status(targets: Targets, kubelet_node: str):
    """The download pod lands on the test kubelet's node, where the test plays its kubelet: it reports the
    pod Running at an IP where a progress endpoint answers, further along at every answer. The operator
    polls it while the download runs (no pass fetches it) and the target's status follows."""
    volume = bind_claim(targets, "progress-cache")
    try:
        targets.create(hub_target("progress", "progress-cache", **nodes.kubelet_placement()))
        (pod,) = eventually(
            lambda: [p for p in hydration_pods(targets) if p.spec.node_name == kubelet_node] or None,
            "the download pod on the test node",
        )
        ip = str(list(ipaddress.ip_network(nodes.gpu_node_pod_cidr(nodes.KUBELET_NODE_INDEX)).hosts())[-1])
        with progress_endpoint(ip, files_total=40) as answered:
            running = {
                "phase": "Running",
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "containerStatuses": [
                    {
                        "name": pod.spec.containers[0].name,
                        "image": pod.spec.containers[0].image,
                        "imageID": "",
                        "ready": True,
                        "restartCount": 0,
                        "state": {"running": {}},
                    }
                ],
            }
            targets.core.patch_namespaced_pod_status(
                pod.metadata.name, targets.namespace, {"status": running}
            )

            def shown() -> tuple[dict, int] | None:
                """The status and the files done it shows, when it shows what the endpoint answered."""
                status = targets.status("progress")
                message = condition(status, "Ready").get("message", "")
                done = [n for n in set(answered) if f": {n}/40 files" in message]
                return (status, done[0]) if done else None

            first, done = eventually(shown, "the download's progress in status")
            ready = condition(first, "Ready")
            assert ready["reason"] == "Downloading"
            assert ready["message"].startswith("downloading org/tiny-llama@main into claim progress-cache: ")
            assert f"{done}/40 files, {done:.1f} of 40.0 GB" in ready["message"]
            later, moved = eventually(
                lambda: (seen := shown()) and seen[1] > done and seen, "progress moving on"
            )
            assert f": {moved}/40 files" in condition(later, "Ready")["message"]
            # Still downloading: the same condition, only its message moved.
            assert condition(later, "Ready")["lastTransitionTime"] == ready["lastTransitionTime"]
    finally:
        targets.core.delete_persistent_volume(volume)
