"""The operator keeps what it owns as it renders it and reports what it cannot do: drift repaired, a foreign
status write undone, an unschedulable target and a child the API server refuses reported in status.

One operator process serves the whole module (only this module's namespaces); each test has its own.
"""

from __future__ import annotations

import pytest
from eagle3_target.protocol import GROUP, PLURAL, VERSION

from support.cluster.waiting import eventually, free_port
from support.targets import Targets, condition, target_manifest

pytestmark = pytest.mark.usefixtures("operator")


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

    # the pod is Ready but nothing answers at its IP: a stable failure
    honest = eventually(
        lambda: targets.status_with_reason("told", "EndpointUnreachable"),
        "the unserved target reported EndpointUnreachable",
    )
    targets.custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, targets.namespace, PLURAL, "told", {"status": {"phase": "Ready", "url": "http://x"}}
    )
    restored = eventually(
        lambda: (
            (s := targets.status_with_reason("told", "EndpointUnreachable"))
            and s.get("url") == honest["url"]
            and s
        ),
        "the foreign status write undone",
    )
    assert restored["phase"] == honest["phase"] == "Failed"


def test_more_gpus_than_any_node_is_unschedulable(targets: Targets):
    targets.create(target_manifest("huge", free_port(), tensorParallelSize=16))

    status = eventually(
        lambda: targets.status_with_reason("huge", "Unschedulable"), "Unschedulable in the Ready condition"
    )
    assert condition(status, "Degraded")["status"] == "True"
    assert status["lastFailure"]["reason"] == "Unschedulable"
    assert "nvidia.com/gpu" in status["lastFailure"]["message"]
    assert status["phase"] == "Failed"
    warnings = eventually(
        lambda: [e for e in targets.events("huge") if e.type == "Warning"], "a Warning event"
    )
    assert any(e.reason == "Unschedulable" for e in warnings)


def test_child_the_api_server_rejects_is_reported_not_retried_forever(targets: Targets):
    """A spec the CRD accepts but whose Deployment the API server refuses (an invalid label key)."""
    targets.create(target_manifest("odd", free_port(), nodeSelector={"not a label key!": "x"}))

    status = eventually(
        lambda: targets.status_with_reason("odd", "InvalidSpec"), "the rejection reported in status"
    )
    assert "rejected" in status["lastFailure"]["message"] and status["phase"] == "Failed"
    assert targets.deployment("odd") is None
