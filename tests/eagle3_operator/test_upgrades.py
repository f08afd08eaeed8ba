"""Operator upgrades and skew on the real control plane: a new operator restarts no target until the user
opts in, a CRD newer than the operator is served (its unknown fields warned about once) and an older one
is refused at startup, and of two leader-electing operators exactly one acts; when the leader is killed
the standby takes over with its indexes warm, and no user sees a change (status, events).

Each test runs its own operator processes on its own namespace (e3up-…, which the module-wide operator
does not serve), except the CRD-skew test, which changes the shared CRD and restores it.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from eagle3_target.protocol import GROUP, PLURAL

from support.cluster.access import Cluster
from support.cluster.waiting import eventually, free_port
from support.crd import crd_manifest
from support.operator_process import OperatorProcess
from support.server_farm import PodServing, ServerFarm
from support.targets import Targets, condition, target_manifest

CRD_NAME = f"{PLURAL}.{GROUP}"
IMAGE_1, IMAGE_2 = "registry.local/eagle3-target:1.0", "registry.local/eagle3-target:2.0"


@pytest.fixture
def own(cluster: Cluster, make_namespace: Callable[[str], str]) -> Targets:
    """A namespace only this test's operators serve."""
    return Targets(cluster, make_namespace("e3up-"))


@pytest.fixture
def serving(own: Targets, servers: ServerFarm) -> Iterator[PodServing]:
    """Servers answering at the pods' IPs in that namespace."""
    with PodServing(own.core, own.namespace, servers) as pods:
        yield pods


def server_image(targets: Targets, name: str) -> str:
    return targets.deployment(name).spec.template.spec.containers[0].image


def test_operator_upgrade_restarts_no_target_until_opted_in(
    own: Targets, serving: PodServing, crd: None, tmp_path: Path, cluster: Cluster
):
    operator = OperatorProcess(
        cluster.kubeconfig, tmp_path, [own.namespace], extra_args=[f"--server-image={IMAGE_1}"]
    )
    operator.start()
    try:
        port = free_port()
        serving.ports.add(port)
        own.create(target_manifest("steady", port))
        eventually(lambda: own.ready_status("steady", replicas=1), "Ready under the first operator")
        before = own.deployment("steady")
        (pod,) = own.pods("steady")
        assert server_image(own, "steady") == IMAGE_1

        # The "upgrade": an operator whose default server image (and version) is newer.
        operator.stop()
        operator.extra_args = [f"--server-image={IMAGE_2}"]
        operator.start()
        eventually(lambda: operator.metric("eagle3_operator_reconciles_total", result="ok") > 0, "a pass")
        time.sleep(2)
        after = own.deployment("steady")
        assert after.metadata.generation == before.metadata.generation
        assert server_image(own, "steady") == IMAGE_1
        assert [p.metadata.uid for p in own.pods("steady")] == [pod.metadata.uid]

        # A Deployment rendered before images were pinned (no pin annotation) keeps the image it runs.
        cluster.kubectl("annotate", "-n", own.namespace, "deployment/steady", "eagle3.dev/server-image-")
        eventually(
            lambda: own.deployment("steady").metadata.annotations.get("eagle3.dev/server-image") == IMAGE_1,
            "the pin restored from the running image",
        )

        # Scaling restarts no pod and keeps the image.
        generation = own.patch_spec("steady", {"replicas": 2})
        eventually(lambda: own.ready_status("steady", generation, replicas=2), "Ready at two replicas")
        assert pod.metadata.uid in {p.metadata.uid for p in own.pods("steady")}
        assert server_image(own, "steady") == IMAGE_1

        # Opting in moves the target to the running operator's image.
        cluster.kubectl("annotate", "-n", own.namespace, "e3t/steady", "eagle3.dev/upgrade-server-image=1")
        eventually(lambda: server_image(own, "steady") == IMAGE_2, "the opted-in upgrade")
        eventually(
            lambda: (
                (s := own.ready_status("steady", replicas=2))
                and pod.metadata.name not in {e["pod"] for e in s["endpoints"]}
            ),
            "Ready on upgraded pods",
        )
    finally:
        operator.stop()


def test_newer_crd_fields_are_warned_once_and_an_older_crd_is_refused(
    own: Targets, serving: PodServing, crd: None, tmp_path: Path, cluster: Cluster
):
    extensions = kubernetes.client.ApiextensionsV1Api(cluster.api_client)
    operator = OperatorProcess(cluster.kubeconfig, tmp_path, [own.namespace])
    try:
        # A newer CRD: schema version 2, and a new defaulted field the API server fills into every target.
        newer = crd_manifest()
        newer["metadata"]["annotations"]["eagle3.dev/schema-version"] = "2"
        spec_schema = newer["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        spec_schema["properties"]["futureKnob"] = {"type": "string", "default": "on"}
        replace_crd(extensions, newer)
        operator.start()
        eventually(lambda: "schema version 2 found (newer" in operator.log(), "the CRD version logged")
        port = free_port()
        serving.ports.add(port)
        own.create(target_manifest("skewed", port))
        assert own.get("skewed")["spec"]["futureKnob"] == "on"
        eventually(lambda: own.ready_status("skewed", replicas=1), "Ready despite the unknown field")
        generation = own.patch_spec("skewed", {"startupTimeoutSeconds": 700})  # more passes
        eventually(lambda: own.ready_status("skewed", generation, replicas=1), "Ready again")
        warnings = [e for e in own.events("skewed") if e.reason == "UnknownFields"]
        assert len(warnings) == 1 and warnings[0].type == "Warning"
        assert "spec.futureKnob" in warnings[0].message
        operator.stop()

        # An older CRD (schema version 0): the operator says so and refuses to start.
        older = crd_manifest()
        older["metadata"]["annotations"]["eagle3.dev/schema-version"] = "0"
        replace_crd(extensions, older)
        refused = subprocess.run(
            [*operator.command(), f"--namespace={own.namespace}", "--liveness=", "--metrics-port=0"],
            capture_output=True,
            text=True,
            env=operator.environment(),
            timeout=60,
        )
        assert refused.returncode == 2
        assert "schema version 0, this operator needs 1" in refused.stderr
    finally:
        operator.stop()
        replace_crd(extensions, crd_manifest())


def replace_crd(extensions: kubernetes.client.ApiextensionsV1Api, crd: dict[str, Any]) -> None:
    """Replace the whole CRD (a PUT, so fields added by an earlier replace go away too)."""
    current = extensions.read_custom_resource_definition(CRD_NAME)
    crd["metadata"]["resourceVersion"] = current.metadata.resource_version
    extensions.replace_custom_resource_definition(CRD_NAME, crd)
    eventually(
        lambda: (
            extensions.read_custom_resource_definition(CRD_NAME).metadata.annotations.get(
                "eagle3.dev/schema-version"
            )
            == crd["metadata"]["annotations"]["eagle3.dev/schema-version"]
        ),
        "the CRD replaced",
    )


def test_two_operators_one_leader_and_a_takeover_after_kill_9_changes_nothing_a_user_sees(
    own: Targets, serving: PodServing, crd: None, tmp_path: Path, cluster: Cluster
):
    election = ["--leader-elect", f"--leader-election-namespace={own.namespace}", "--leader-election-name=e3"]
    first, second = (
        OperatorProcess(cluster.kubeconfig, tmp_path, [own.namespace], extra_args=election, name=name)
        for name in ("first", "second")
    )
    coordination = kubernetes.client.CoordinationV1Api(cluster.api_client)
    try:
        first.start()
        eventually(lambda: "leads" in first.log(), "the first operator to lead")
        second.start()  # its liveness answers while it waits
        # Both are ready: the standby waiting for the Lease, the leader acting.
        assert second.readiness() == (200, {"ready": True, "standby": True, "leading": False})
        assert first.readiness() == (200, {"ready": True, "standby": False, "leading": True})
        port = free_port()
        serving.ports.add(port)
        own.create(target_manifest("shared", port))
        eventually(lambda: own.ready_status("shared", replicas=1), "Ready under the leader")
        time.sleep(3)
        assert "leads" not in second.log()
        assert second.metric_total("eagle3_operator_reconciles_total") == 0
        assert second.metric_total("eagle3_operator_status_writes_total") == 0
        assert second.metric_total("eagle3_operator_child_applies_total") == 0

        before = own.get("shared")
        events = [(e.reason, e.count) for e in own.events("shared")]

        first.kill()  # SIGKILL: the lease is not released, it has to run out
        died = time.monotonic()
        samples: list[dict[str, Any]] = []
        took_over: float | None = None
        # Until the new leader has had its first verdicts and a few probe periods more.
        while took_over is None or time.monotonic() < died + took_over + 12:
            samples.append(own.get("shared")["status"])
            if took_over is None and "leads" in second.log():
                took_over = time.monotonic() - died
            assert time.monotonic() - died < 60, "the standby never took over"
            time.sleep(0.3)
        assert took_over < 30, took_over
        # Nothing a user sees changed: never not Ready, nothing written, no event.
        for status in samples:
            assert condition(status, "Ready")["status"] == "True", status
            assert condition(status, "Available")["status"] == "True", status
        after = own.get("shared")
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
        assert [(e.reason, e.count) for e in own.events("shared")] == events
        assert second.metric_total("eagle3_operator_status_writes_total") == 0

        # Its indexes were warm: a change is acted on within seconds of winning.
        changed = time.monotonic()
        generation = own.patch_spec("shared", {"startupTimeoutSeconds": 700})
        eventually(lambda: own.ready_status("shared", generation, replicas=1), "Ready under the new leader")
        assert own.deployment("shared").spec.progress_deadline_seconds == 1000
        assert time.monotonic() - changed < 10

        second.stop()  # a clean stop hands the lease back at once
        lease = coordination.read_namespaced_lease("e3", own.namespace)
        assert not lease.spec.holder_identity
        assert lease.spec.lease_transitions >= 1
    finally:
        first.stop()
        second.stop()
