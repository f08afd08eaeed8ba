"""Drift detection without a cluster: what counts as "the child still matches its rendering"."""

import copy

from eagle3_operator.reconciler import essence, matches
from eagle3_operator.render import build_deployment, build_service, owner_reference
from eagle3_operator.spec import Eagle3TargetSpec

SPEC = Eagle3TargetSpec.parse(
    {
        "model": {"name": "tiny", "source": {"pvc": {"claimName": "models"}}},
        "engine": "hf",
        "tensorParallelSize": 2,
        "resources": {"requests": {"memory": "1024Mi", "cpu": "500m"}},
    }
)
OWNER = owner_reference("t", "uid-1")


def as_stored(manifest: dict) -> dict:
    """The manifest as the API server returns it: defaults added, quantities in canonical form."""
    stored = copy.deepcopy(manifest)
    stored["metadata"] |= {"uid": "child-uid", "resourceVersion": "7", "generation": 1}
    stored["metadata"]["annotations"] = {"deployment.kubernetes.io/revision": "1"}
    stored["status"] = {"replicas": 1}
    if stored["kind"] == "Deployment":
        pod = stored["spec"]["template"]["spec"]
        pod |= {"restartPolicy": "Always", "dnsPolicy": "ClusterFirst", "schedulerName": "default-scheduler"}
        container = pod["containers"][0]
        container |= {"terminationMessagePath": "/dev/termination-log"}
        container["resources"]["requests"] |= {"memory": "1Gi", "nvidia.com/gpu": "2"}
        container["resources"]["limits"]["nvidia.com/gpu"] = "2"
        container["readinessProbe"]["httpGet"]["scheme"] = "HTTP"
    else:
        stored["spec"] |= {"clusterIP": "127.2.0.10", "sessionAffinity": "None"}
    return stored


def test_server_defaults_and_canonical_quantities_are_not_drift():
    for manifest in (build_deployment("t", "ns", SPEC, OWNER), build_service("t", "ns", SPEC, OWNER)):
        assert matches(essence(manifest), essence(as_stored(manifest)))


def test_changed_fields_are_drift():
    deployment = build_deployment("t", "ns", SPEC, OWNER)
    edits = [
        lambda d: d["spec"].__setitem__("replicas", 3),
        lambda d: d["spec"]["template"]["spec"]["containers"][0].__setitem__("image", "evil:1"),
        lambda d: d["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"].pop("nvidia.com/gpu"),
        lambda d: d["metadata"]["labels"].pop("app.kubernetes.io/managed-by"),
        lambda d: d["spec"]["template"]["spec"]["volumes"].append({"name": "extra", "emptyDir": {}}),
        lambda d: d["metadata"].pop("ownerReferences"),
    ]
    for edit in edits:
        stored = as_stored(deployment)
        edit(stored)
        assert not matches(essence(deployment), essence(stored))


def test_quantities_compare_by_value_and_other_scalars_exactly():
    assert matches({"memory": "1024Mi"}, {"memory": "1Gi"})
    assert matches({"gpu": 2}, {"gpu": "2"})
    assert not matches({"memory": "1Gi"}, {"memory": "2Gi"})
    assert not matches({"port": "http"}, {"port": "https"})
    assert not matches({"flag": True}, {"flag": 1})
    assert not matches({"items": [1, 2]}, {"items": [1, 2, 3]})
