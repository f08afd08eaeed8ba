"""Conditions over time: transition times move only when a status does, and events announce what changed
once, as a Warning when it is a failure."""

from datetime import timedelta

from eagle3_operator.status.conditions import transitions
from eagle3_operator.status.document import compute_status, status_patch
from eagle3_operator.status.observation import Failure, ProbeResult

from support.observations import INFO, T0, make_deployment, make_pod, make_spec, observe
from support.targets import condition


def test_transition_times_move_only_on_status_change():
    first = compute_status(observe(), {}, T0)
    later = T0 + timedelta(minutes=5)
    same = compute_status(observe(), first, later)
    assert status_patch(first, same) == {}
    assert condition(same, "Ready")["lastTransitionTime"] == "2026-11-30T03:00:00Z"

    not_ready = {"t-a": ProbeResult(True, INFO), "t-b": ProbeResult(False, error="/readyz answered 503")}
    changed = compute_status(observe(probes=not_ready), same, later)
    assert condition(changed, "Ready")["lastTransitionTime"] == "2026-11-30T03:05:00Z"
    assert condition(changed, "Degraded")["lastTransitionTime"] == "2026-11-30T03:00:00Z"  # still False
    patch = status_patch(same, changed)
    assert set(patch) >= {"conditions", "endpoints", "phase", "readyReplicas"}
    assert "url" not in patch and "observedGeneration" not in patch


def test_transitions_warn_on_failure_and_inform_on_ready():
    ready = compute_status(observe(), {}, T0)
    events = transitions({}, ready)
    # A new target: one event for Ready; "not progressing" and "not degraded" are not news.
    assert [(e.type, e.reason, e.message.split(":")[0]) for e in events] == [
        ("Normal", "AllReplicasReady", "Ready=True")
    ]
    assert transitions(ready, compute_status(observe(), ready, T0)) == []
    crash = make_pod("t-a", ready=False, failure=Failure("CrashLoopBackOff", "back-off"))
    failing = compute_status(observe(pods=(crash, make_pod("t-b"))), ready, T0)
    warnings = {e.reason for e in transitions(ready, failing) if e.type == "Warning"}
    assert warnings == {"CrashLoopBackOff"}


def test_available_is_announced_only_when_ready_does_not_say_it():
    ready = compute_status(observe(), {}, T0)
    assert [e.reason for e in transitions({}, ready)] == ["AllReplicasReady"]
    scaling = compute_status(
        observe(spec=make_spec(replicas=3), deployment=make_deployment(desired=3)), ready, T0
    )
    assert [e.reason for e in transitions(ready, scaling)] == ["RollingOut"]  # one event per reason
    gone = {name: ProbeResult(False, error="refused", reachable=False) for name in ("t-a", "t-b")}
    outage = compute_status(
        observe(spec=make_spec(replicas=3), deployment=make_deployment(desired=3), probes=gone), scaling, T0
    )
    assert condition(outage, "Available")["status"] == "False"
    # Available went False for the reason Ready's Warning already names: one event for that reason.
    events = [(e.type, e.reason) for e in transitions(scaling, outage)]
    assert events.count(("Warning", "EndpointUnreachable")) == 1
