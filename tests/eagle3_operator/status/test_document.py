"""The stored status document: the last failure kept after recovery, removed fields patched to null, every
field in the CRD's schema, and an idle loop that writes nothing."""

from datetime import timedelta
from typing import Any

from eagle3_operator.status.document import STATUS_KEYS, compute_status, status_patch
from eagle3_operator.status.observation import Failure, ProbeResult
from hypothesis import given, settings
from hypothesis import strategies as st

from support.crd import crd_manifest
from support.observations import INFO, T0, make_deployment, make_pod, make_spec, observe
from support.targets import condition


def test_last_failure_time_is_kept_for_the_same_reason_and_after_recovery():
    crash = make_pod("t-a", ready=False, failure=Failure("CrashLoopBackOff", "back-off 10s"))
    obs = observe(pods=(crash, make_pod("t-b")))
    first = compute_status(obs, {}, T0)
    crash_again = make_pod("t-a", ready=False, failure=Failure("CrashLoopBackOff", "back-off 20s"))
    second = compute_status(observe(pods=(crash_again, make_pod("t-b"))), first, T0 + timedelta(seconds=30))
    assert second["lastFailure"]["time"] == first["lastFailure"]["time"]
    assert second["lastFailure"]["message"].endswith("back-off 20s")
    healed = compute_status(observe(), second, T0 + timedelta(minutes=2))
    assert condition(healed, "Ready")["status"] == "True"
    assert healed["lastFailure"] == second["lastFailure"]


def test_removed_fields_are_patched_to_null():
    served = compute_status(observe(), {}, T0)
    suspended = compute_status(observe(spec=make_spec(suspend=True), pods=(), probes={}), served, T0)
    patch = status_patch(served, suspended)
    assert patch["model"] is None


def _schema_paths(schema: dict[str, Any], value: Any, path: str = "status") -> list[str]:
    """Paths in `value` that the structural schema would prune (unknown fields)."""
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        missing = [f"{path}.{key}" for key in value if key not in properties]
        return missing + [
            p
            for key in value
            if key in properties
            for p in _schema_paths(properties[key], value[key], f"{path}.{key}")
        ]
    if isinstance(value, list):
        return [p for item in value for p in _schema_paths(schema.get("items", {}), item, f"{path}[]")]
    return []


def test_every_status_field_is_in_the_crd_schema():
    """A field the schema lacks is pruned by the API server, and the operator would rewrite it forever."""
    crd = crd_manifest()
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    failing = compute_status(
        observe(pods=(make_pod("t-a", failure=Failure("CrashLoopBackOff", "x")),)), {}, T0
    )
    for status in (compute_status(observe(), {}, T0), failing):
        assert set(status) <= set(STATUS_KEYS)
        assert _schema_paths(schema, status) == []


pods_strategy = st.lists(
    st.builds(
        make_pod,
        name=st.sampled_from(["t-a", "t-b", "t-c"]),
        ip=st.sampled_from([None, "127.1.0.5"]),
        ready=st.booleans(),
        terminating=st.booleans(),
        failure=st.sampled_from([None, Failure("CrashLoopBackOff", "x"), Failure("Unschedulable", "y")]),
    ),
    max_size=3,
    unique_by=lambda p: p.name,
)
probe_strategy = st.sampled_from(
    [
        ProbeResult(True, INFO),
        ProbeResult(False, error="503"),
        ProbeResult(False, error="refused", reachable=False),
    ]
)


@settings(max_examples=150, deadline=None)
@given(
    pods=pods_strategy,
    probe=probe_strategy,
    replicas=st.integers(0, 3),
    suspend=st.booleans(),
    lag=st.booleans(),
    minutes=st.integers(0, 60),
)
def test_recomputing_from_the_stored_status_writes_nothing(pods, probe, replicas, suspend, lag, minutes):
    """The operator's idle loop: the same observation, later, must produce an empty patch."""
    deployment = make_deployment(desired=replicas, replicas=len(pods), observed_generation=1 - int(lag))
    obs = observe(
        spec=make_spec(replicas=replicas, suspend=suspend),
        pods=tuple(pods),
        deployment=deployment,
        probes={pod.name: probe for pod in pods},
    )
    first = compute_status(obs, {}, T0 + timedelta(hours=1))
    assert status_patch(first, compute_status(obs, first, T0 + timedelta(hours=1, minutes=minutes))) == {}
    assert first["phase"] in {"Pending", "Loading", "Ready", "Degraded", "Failed", "Suspended"}
    assert [c["type"] for c in first["conditions"]] == ["Ready", "Available", "Progressing", "Degraded"]
    offered = first["readyReplicas"] > 0 and replicas > 0 and not suspend
    assert (condition(first, "Available")["status"] == "True") == offered
    if condition(first, "Ready")["status"] == "True":
        assert condition(first, "Available")["status"] == "True"
        assert first["readyReplicas"] == replicas > 0 and not suspend and not lag
        assert all(e["ready"] for e in first["endpoints"]) and len(first["endpoints"]) == replicas


def test_members_that_disappear_at_any_depth_are_patched_to_null():
    """Review round 3, B5: a merge patch keeps what it does not name, so a model restarted without a revision
    kept the old one next to its new fingerprint."""
    before = {"model": {"name": "m", "revision": "abc123", "fingerprint": "sha256:old"}, "phase": "Ready"}
    after = {"model": {"name": "m", "fingerprint": "sha256:new"}, "phase": "Ready"}
    patch = status_patch(before, after)
    assert patch == {"model": {"revision": None, "fingerprint": "sha256:new"}}
    assert apply_merge_patch(before, patch) == after
    gone = {"consumers": {"active": 1, "clients": ["a"]}}
    assert status_patch(gone, {}) == {"consumers": None}


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386's MergePatch, as the API server applies it."""
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = apply_merge_patch(merged.get(key), value)
    return merged
