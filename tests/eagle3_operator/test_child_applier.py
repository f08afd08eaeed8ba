"""Apply decisions without a cluster: the rendered digest a child is stamped with (spec changes, removals
included), what counts as "someone else changed the child" (drift), and how long a refused apply is held."""

import copy

import pytest
from eagle3_operator.child_applier import ChildWrites, matches
from eagle3_operator.constants import ANNOTATION_RENDERED_DIGEST
from eagle3_operator.indexes import essence
from eagle3_operator.render.children import build_children, rendered_digest, stamp_digest
from eagle3_operator.render.deployment import build_deployment
from eagle3_operator.render.names import owner_reference
from eagle3_operator.render.network import build_service
from eagle3_operator.render.server_command import model_identity, server_args
from eagle3_operator.spec import Eagle3TargetSpec
from eagle3_operator.status.observation import Failure

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
    stored["metadata"]["annotations"] = {
        **stored["metadata"].get("annotations", {}),
        "deployment.kubernetes.io/revision": "1",
    }
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


FULL = {
    "model": {"name": "tiny", "source": {"pvc": {"claimName": "models"}}},
    "engine": "hf",
    "tensorParallelSize": 1,
    "resources": {"requests": {"memory": "1Gi", "cpu": "2"}, "limits": {"memory": "2Gi"}},
    "nodeSelector": {"pool": "gpu"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
    "affinity": {"nodeAffinity": {}},
    "priorityClassName": "training",
    "imagePullSecrets": [{"name": "registry"}],
    "monitoring": {"podMonitor": {"enabled": True, "labels": {"release": "prom"}}},
}
REMOVALS = {
    "nodeSelector": lambda s: s.pop("nodeSelector"),
    "tolerations": lambda s: s.pop("tolerations"),
    "affinity": lambda s: s.pop("affinity"),
    "priorityClassName": lambda s: s.pop("priorityClassName"),
    "imagePullSecrets": lambda s: s.pop("imagePullSecrets"),
    "limits.memory": lambda s: s["resources"]["limits"].pop("memory"),
    "requests.cpu": lambda s: s["resources"]["requests"].pop("cpu"),
    "podMonitor.labels": lambda s: s["monitoring"]["podMonitor"].pop("labels"),
    "GPUs 1 -> 0": lambda s: s.__setitem__("tensorParallelSize", 0),
}


@pytest.mark.parametrize("removed", sorted(REMOVALS))
def test_a_removed_spec_field_moves_the_digest_where_subset_matching_sees_nothing(removed):
    """The review's reproduction: the stored child is a superset of the smaller rendering, so drift matching
    alone skips it; the stamped digest differs, so the child is applied and server-side apply prunes."""
    spec = copy.deepcopy(FULL)
    REMOVALS[removed](spec)
    before = build_children("t", "ns", "uid-1", Eagle3TargetSpec.parse(FULL), pod_monitor_supported=True)
    after = build_children("t", "ns", "uid-1", Eagle3TargetSpec.parse(spec), pod_monitor_supported=True)
    moved = [
        new["kind"]
        for old, new in zip(before, after, strict=True)
        if rendered_digest(old) != rendered_digest(new)
    ]
    assert moved, removed
    for old, new in zip(before, after, strict=True):
        if new["kind"] in moved and new["kind"] != "PodMonitor":
            assert matches(essence(unstamped(new)), essence(unstamped(old))), (
                removed,
                new["kind"],
            )


def unstamped(manifest: dict) -> dict:
    bare = copy.deepcopy(manifest)
    annotations = bare["metadata"].pop("annotations")
    del annotations[ANNOTATION_RENDERED_DIGEST]
    if annotations:
        bare["metadata"]["annotations"] = annotations
    return bare


def test_digest_is_stamped_stable_and_excludes_itself():
    first = build_children("t", "ns", "uid-1", SPEC, pod_monitor_supported=False)
    again = build_children("t", "ns", "uid-1", SPEC, pod_monitor_supported=False)
    for child, same in zip(first, again, strict=True):
        digest = rendered_digest(child)
        assert digest and digest == rendered_digest(same)
        assert rendered_digest(stamp_digest(unstamped(child))) == digest
    # The pod template carries no digest: scaling or a label change must not restart pods.
    template = first[0]["spec"]["template"]["metadata"]
    assert ANNOTATION_RENDERED_DIGEST not in (template.get("annotations") or {})


def test_scaling_changes_no_pod_template():
    one = build_deployment("t", "ns", SPEC, OWNER)
    three = build_deployment("t", "ns", SPEC.model_copy(update={"replicas": 3}), OWNER)
    assert one["spec"]["template"] == three["spec"]["template"]
    assert (one["spec"]["replicas"], three["spec"]["replicas"]) == (1, 3)


def test_model_identity_keeps_only_the_model_deciding_flags():
    command = server_args(SPEC.model_copy(update={"max_model_len": 4096, "engine_args": {"seed": "1"}}))
    identity = model_identity(command)
    assert identity[:4] == ("--model", "/models", "--engine", "hf")
    assert "--max-model-len" not in identity and "--engine-arg" not in identity and "--port" not in identity
    assert model_identity(server_args(SPEC.model_copy(update={"port": 9000}))) == identity


def test_a_refusal_is_held_until_its_retry_is_due_and_no_longer():
    """A pass before the retry is due reports the refusal again; a changed rendering is applied at once; the
    hold ends at its own deadline, on the clock the pass that asked for the retry compares with."""
    writes = ChildWrites()
    first = Failure("QuotaExceeded", "exceeded quota: gpus")
    writes.refuse(("a", "b"), first, retry_at=10.0)
    assert writes.still_refused(("a", "b"), 9.5) == (first, 10.0)
    assert writes.still_refused(("a", "c"), 9.5) is None  # a changed rendering is applied at once
    assert writes.still_refused(("a", "b"), 10.0) is None  # due: the next pass applies again

    second = Failure("QuotaExceeded", "exceeded quota: gpus")
    writes.refuse(("a", "c"), second, retry_at=30.0)  # refused again: a newer hold, a longer backoff
    assert writes.still_refused(("a", "c"), 12.0) == (second, 30.0)
