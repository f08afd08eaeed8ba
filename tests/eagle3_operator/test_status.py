"""Status from observation, without a cluster: the rules users and training jobs rely on."""

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from eagle3_operator.spec import Eagle3TargetSpec
from eagle3_operator.status.conditions import transitions
from eagle3_operator.status.document import STATUS_KEYS, compute_status, status_patch
from eagle3_operator.status.observation import (
    DeploymentView,
    Failure,
    JobView,
    Observation,
    PodView,
    ProbeResult,
)
from eagle3_operator.status.observe import deployment_view, describe_progress, hydration_state, pod_view
from eagle3_target.protocol import HydrationProgress, ServedModel
from hypothesis import given, settings
from hypothesis import strategies as st

T0 = datetime(2026, 11, 30, 3, 0, 0, tzinfo=UTC)
CRD = Path(__file__).parents[2] / "crds" / "eagle3targets.eagle3.dev.yaml"
INFO = ServedModel(
    name="tiny-llama",
    revision="abc123",
    dtype="float32",
    engine="hf",
    num_hidden_layers=4,
    hidden_size=32,
    vocab_size=256,
    aux_layer_ids=[0, 1, 2],
    fingerprint="sha256:aaaa",
)


def make_spec(**overrides: Any) -> Eagle3TargetSpec:
    raw = {
        "model": {"name": "tiny-llama", "source": {"hostPath": {"path": "/models/tiny"}}},
        "engine": "hf",
        "tensorParallelSize": 0,
        "replicas": 2,
        "port": 18000,
        "startupTimeoutSeconds": 600,
    }
    return Eagle3TargetSpec.parse(raw | overrides)


def make_pod(name: str, ip: str | None = "127.1.0.5", **overrides: Any) -> PodView:
    fields = {
        "name": name,
        "ip": ip,
        "node": "gpu-0",
        "ready": True,
        "terminating": False,
        "created": T0,
        "started": T0,
        "failure": None,
    }
    return PodView(**(fields | overrides))


def make_deployment(**overrides: Any) -> DeploymentView:
    fields = {
        "generation": 1,
        "observed_generation": 1,
        "desired": 2,
        "replicas": 2,
        "ready_replicas": 2,
        "updated_replicas": 2,
        "failure": None,
    }
    return DeploymentView(**(fields | overrides))


def observe(spec: Eagle3TargetSpec | None = None, **overrides: Any) -> Observation:
    pods = (make_pod("t-a", "127.1.0.5"), make_pod("t-b", "127.1.0.6"))
    fields = {
        "generation": 3,
        "spec": spec or make_spec(),
        "url": "http://t.ns.svc:18000",
        "selector": "app.kubernetes.io/instance=t,app.kubernetes.io/name=eagle3-target",
        "deployment": make_deployment(),
        "pods": pods,
        "probes": {pod.name: ProbeResult(ready=True, info=INFO) for pod in pods},
    }
    return Observation(**(fields | overrides))


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


def test_all_replicas_serving_is_ready_with_endpoints_and_model():
    status = compute_status(observe(), {}, T0)
    ready = condition(status, "Ready")
    assert (ready["status"], ready["reason"], ready["observedGeneration"]) == ("True", "AllReplicasReady", 3)
    assert condition(status, "Progressing")["status"] == "False"
    assert condition(status, "Degraded")["status"] == "False"
    assert status["phase"] == "Ready"
    assert status["observedGeneration"] == 3
    assert status["endpoints"] == [
        {"pod": "t-a", "address": "http://127.1.0.5:18000", "ready": True, "node": "gpu-0"},
        {"pod": "t-b", "address": "http://127.1.0.6:18000", "ready": True, "node": "gpu-0"},
    ]
    assert status["model"] == {
        "name": "tiny-llama",
        "revision": "abc123",
        "dtype": "float32",
        "engine": "hf",
        "numHiddenLayers": 4,
        "hiddenSize": 32,
        "vocabSize": 256,
        "auxLayerIds": [0, 1, 2],
        "fingerprint": "sha256:aaaa",
    }
    assert (status["readyReplicas"], status["replicas"], status["readyDesired"]) == (2, 2, "2/2")
    assert status["url"] == "http://t.ns.svc:18000"
    assert status["selector"].startswith("app.kubernetes.io/instance=t")
    assert "lastFailure" not in status or status["lastFailure"] is None


def test_pod_whose_server_is_not_ready_is_not_a_ready_endpoint():
    probes = {
        "t-a": ProbeResult(ready=True, info=INFO),
        "t-b": ProbeResult(False, error="/readyz answered 503"),
    }
    status = compute_status(observe(probes=probes), {}, T0)
    assert [e["ready"] for e in status["endpoints"]] == [True, False]
    ready = condition(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "Loading")
    assert "503" in ready["message"]
    assert condition(status, "Progressing")["status"] == "True"
    assert (status["phase"], status["readyReplicas"], status["readyDesired"]) == ("Loading", 1, "1/2")


def test_unreachable_server_behind_a_ready_pod_is_degraded():
    probes = {
        "t-a": ProbeResult(ready=True, info=INFO),
        "t-b": ProbeResult(False, "x", "ConnectError", False),
    }
    status = compute_status(observe(probes=probes), {}, T0)
    assert [e["ready"] for e in status["endpoints"]] == [True, False]
    degraded = condition(status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "EndpointUnreachable")
    assert status["phase"] == "Degraded"  # one replica still serves
    assert status["lastFailure"]["reason"] == "EndpointUnreachable"


def test_unschedulable_pod_surfaces_in_conditions_and_last_failure():
    stuck = make_pod(
        "t-b",
        ip=None,
        node=None,
        ready=False,
        started=None,
        failure=Failure("Unschedulable", "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."),
    )
    pods = (stuck,)
    obs = observe(pods=pods, probes={}, deployment=make_deployment(desired=1, replicas=1, updated_replicas=1))
    status = compute_status(obs, {}, T0)
    for kind, expected in (("Ready", "False"), ("Progressing", "False"), ("Degraded", "True")):
        assert (condition(status, kind)["status"], condition(status, kind)["reason"]) == (
            expected,
            "Unschedulable",
        )
    assert "Insufficient nvidia.com/gpu" in condition(status, "Ready")["message"]
    assert status["phase"] == "Failed"
    assert status["lastFailure"] == {
        "reason": "Unschedulable",
        "message": "pod t-b: 0/2 nodes are available: 2 Insufficient nvidia.com/gpu.",
        "time": "2026-11-30T03:00:00Z",
    }
    assert status["endpoints"] == []  # no IP yet: nothing to publish


def test_startup_timeout_depends_on_the_clock():
    slow = make_pod("t-a", ready=False, started=T0)
    obs = observe(
        spec=make_spec(replicas=1),
        pods=(slow,),
        probes={},
        deployment=make_deployment(desired=1, replicas=1, updated_replicas=1),
    )
    early = compute_status(obs, {}, T0 + timedelta(seconds=599))
    assert condition(early, "Progressing")["status"] == "True"
    late = compute_status(obs, early, T0 + timedelta(seconds=601))
    assert condition(late, "Ready")["reason"] == "StartupTimeout"
    assert "not ready within startupTimeoutSeconds=600" in late["lastFailure"]["message"]


def test_most_actionable_failure_wins():
    pods = (
        make_pod("t-a", ready=False, failure=Failure("CrashLoopBackOff", "back-off 10s")),
        make_pod("t-b", ready=False, failure=Failure("ImagePullBackOff", "no such image")),
    )
    status = compute_status(observe(pods=pods, probes={}), {}, T0)
    assert condition(status, "Degraded")["reason"] == "ImagePullBackOff"
    assert status["phase"] == "Failed"


def test_rollout_in_progress_is_not_ready_even_with_old_pods_serving():
    obs = observe(deployment=make_deployment(generation=2, observed_generation=1, updated_replicas=0))
    status = compute_status(obs, {}, T0)
    assert (condition(status, "Ready")["status"], condition(status, "Ready")["reason"]) == (
        "False",
        "RollingOut",
    )
    assert condition(status, "Progressing")["status"] == "True"
    assert status["model"]["fingerprint"] == "sha256:aaaa"  # old pods still answer: shown, not Ready


def test_deployment_not_yet_scaled_to_spec_is_rolling_out():
    obs = observe(spec=make_spec(replicas=3))
    assert condition(compute_status(obs, {}, T0), "Ready")["reason"] == "RollingOut"


def test_suspend_reports_suspending_then_suspended():
    spec = make_spec(suspend=True)
    stopping = compute_status(observe(spec=spec, deployment=make_deployment(desired=0)), {}, T0)
    assert condition(stopping, "Progressing")["reason"] == "Suspending"
    assert (condition(stopping, "Ready")["status"], stopping["phase"]) == ("False", "Suspended")
    empty = make_deployment(desired=0, replicas=0, updated_replicas=0, ready_replicas=0)
    stopped = compute_status(observe(spec=spec, deployment=empty, pods=(), probes={}), stopping, T0)
    assert (condition(stopped, "Progressing")["status"], condition(stopped, "Progressing")["reason"]) == (
        "False",
        "Suspended",
    )
    assert stopped["readyDesired"] == "0/0"
    assert stopped["endpoints"] == []


def test_fingerprint_mismatch_after_rollout_is_degraded():
    other = INFO.model_copy(update={"fingerprint": "sha256:bbbb"})
    probes = {"t-a": ProbeResult(True, INFO), "t-b": ProbeResult(True, other)}
    status = compute_status(observe(probes=probes), {}, T0)
    assert condition(status, "Degraded")["reason"] == "FingerprintMismatch"
    assert condition(status, "Ready")["status"] == "False"
    assert status["lastFailure"]["reason"] == "FingerprintMismatch"


def test_external_endpoint_ready_not_ready_and_unreachable():
    spec = make_spec(model={"name": "remote"}, endpoint={"url": "http://127.0.0.1:9"})
    base = {"pods": (), "deployment": None, "url": "http://127.0.0.1:9", "selector": None}
    ready = compute_status(
        observe(spec=spec, probes={"http://127.0.0.1:9": ProbeResult(True, INFO)}, **base), {}, T0
    )
    assert (condition(ready, "Ready")["status"], ready["phase"]) == ("True", "Ready")
    assert ready["endpoints"] == [{"address": "http://127.0.0.1:9", "ready": True}]
    assert ready["model"]["fingerprint"] == "sha256:aaaa"
    assert "selector" not in ready or ready["selector"] is None

    loading = compute_status(
        observe(spec=spec, probes={"http://127.0.0.1:9": ProbeResult(False, error="503")}, **base), ready, T0
    )
    assert (condition(loading, "Ready")["reason"], loading["phase"]) == ("EndpointNotReady", "Loading")
    assert loading["model"] is None

    gone = ProbeResult(False, error="ConnectError", reachable=False)
    down = compute_status(observe(spec=spec, probes={"http://127.0.0.1:9": gone}, **base), loading, T0)
    assert (condition(down, "Degraded")["status"], down["phase"]) == ("True", "Failed")
    assert down["lastFailure"]["reason"] == "EndpointUnreachable"


def test_invalid_spec_fails_but_keeps_what_is_served():
    served = compute_status(observe(), {}, T0)
    status = compute_status(
        Observation(generation=4, spec=None, spec_error="spec.port: too small"), served, T0
    )
    assert condition(status, "Ready")["reason"] == "InvalidSpec"
    assert condition(status, "Ready")["observedGeneration"] == 4
    assert status["phase"] == "Failed"
    assert status["lastFailure"]["message"] == "spec.port: too small"
    assert status["endpoints"] == served["endpoints"]
    assert status["model"] == served["model"]


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


def test_pod_view_reads_failures_from_the_pod():
    unschedulable = {
        "metadata": {"name": "p", "creationTimestamp": "2026-11-30T03:00:00Z"},
        "spec": {},
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.",
                }
            ],
        },
    }
    view = pod_view(unschedulable)
    assert view.failure == Failure("Unschedulable", "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.")
    assert (view.ready, view.ip, view.node, view.created) == (False, None, None, T0)

    pulling = {
        "metadata": {"name": "p", "deletionTimestamp": "2026-11-30T03:00:00Z"},
        "spec": {"nodeName": "gpu-0"},
        "status": {
            "podIP": "127.1.0.9",
            "startTime": "2026-11-30T03:00:00Z",
            "conditions": [{"type": "Ready", "status": "False"}],
            "containerStatuses": [
                {"name": "server", "state": {"waiting": {"reason": "ErrImagePull", "message": "not found"}}}
            ],
        },
    }
    view = pod_view(pulling)
    assert view.failure == Failure("ImagePullBackOff", "container server: not found")
    # Not running yet (pulling, downloading): the startup budget has not started.
    assert (view.terminating, view.node, view.ip, view.started) == (True, "gpu-0", "127.1.0.9", None)

    command = ["eagle3-target", "serve", "--model", "/models", "--engine", "hf", "--port", "8000"]
    running = {
        "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "server", "command": command}]},
        "status": {
            "phase": "Running",
            "startTime": "2026-11-30T02:00:00Z",
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [
                {"name": "server", "state": {"running": {"startedAt": "2026-11-30T03:00:00Z"}}}
            ],
        },
    }
    view = pod_view(running)
    assert view.ready and view.failure is None
    assert view.started == T0  # the server container's start, not the pod's (image pull, init containers)
    assert view.identity == ("--model", "/models", "--engine", "hf")


def test_finished_pods_are_not_viewed():
    """Evicted, refused by the kubelet's admission, shut down with their node, or exited: the ReplicaSet has
    replaced them, so they are neither endpoints nor replicas (the pod index drops them)."""
    for phase, reason in (("Failed", "Evicted"), ("Failed", "UnexpectedAdmissionError"), ("Succeeded", "")):
        pod = {
            "metadata": {"name": "p"},
            "spec": {"nodeName": "gpu-0"},
            "status": {"phase": phase, "reason": reason, "podIP": "127.1.0.9"},
        }
        assert pod_view(pod) is None


LOAD_FAILED_LINE = "unknown engine argument no_such_arg; supported: block_size, ..."


def server_status(**container: Any) -> dict[str, Any]:
    """A pod whose server container has the given status fields (name, ready and restartCount preset)."""
    fields = {"name": "server", "ready": False, "restartCount": 0} | container
    return {
        "metadata": {"name": "p"},
        "spec": {"nodeName": "gpu-0"},
        "status": {"podIP": "127.1.0.9", "conditions": [{"type": "Ready", "status": "False"}],
                   "containerStatuses": [fields]},
    }  # fmt: skip


def test_pod_view_reads_a_server_that_gave_up_loading_from_its_first_exit_on():
    terminated = {"exitCode": 3, "reason": "Error", "message": LOAD_FAILED_LINE + "\n"}
    first_exit = server_status(state={"terminated": terminated})
    expected = f"{LOAD_FAILED_LINE} (container server exited with code 3, 0 restarts)"
    assert pod_view(first_exit).failure == Failure("ModelLoadFailed", expected)
    # Restarted: running (loading again) or backing off, the last exit still explains the pod.
    backing_off = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s restarting failed"}}
    for state in ({"running": {}}, backing_off):
        view = pod_view(server_status(state=state, lastState={"terminated": terminated}, restartCount=2))
        assert view.failure == Failure("ModelLoadFailed", expected.replace("0 restarts", "2 restarts"))
    # Ready again: history is history.
    recovered = server_status(state={"running": {}}, lastState={"terminated": terminated}, ready=True)
    assert pod_view(recovered).failure is None
    # A usage error leaves no termination file; the kubelet's fallback is the log tail, spread on lines.
    usage = {"exitCode": 2, "reason": "Error", "message": "Usage: eagle3-target serve\nError: No such option"}
    view = pod_view(server_status(state={"terminated": usage}))
    assert view.failure.reason == "ModelLoadFailed"
    assert view.failure.message.startswith("Usage: eagle3-target serve Error: No such option (")


def test_pod_view_tells_oom_kills_and_failed_downloads_from_other_crashes():
    oom = {"exitCode": 137, "reason": "OOMKilled"}
    view = pod_view(server_status(state={"running": {}}, lastState={"terminated": oom}, restartCount=1))
    assert view.failure.reason == "OOMKilled" and "spec.resources.limits.memory" in view.failure.message
    crash = {"exitCode": 139, "reason": "Error", "message": "Segmentation fault"}
    assert pod_view(server_status(state={"terminated": crash})).failure is None  # not a load failure
    back_off = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s"}}
    crash_loop = pod_view(server_status(state=back_off, lastState={"terminated": crash}))
    assert crash_loop.failure == Failure("CrashLoopBackOff", "container server: back-off 20s")
    gated = {"exitCode": 2, "message": "org/tiny@main: gated repository; the token may not read it"}
    hydration = {
        "metadata": {"name": "h", "labels": {"app.kubernetes.io/component": "model-hydration"}},
        "status": {"phase": "Failed", "containerStatuses": [
            {"name": "download-model", "ready": False, "restartCount": 0, "state": {"terminated": gated}}
        ]},
    }  # fmt: skip
    view = pod_view(hydration)
    assert view.hydration and view.finished
    exited = "container download-model exited with code 2, 0 restarts"
    assert view.failure == Failure("ModelDownloadFailed", f"{gated['message']} ({exited})")
    waiting = server_status(state={"waiting": {"reason": "PodInitializing"}})
    waiting["status"]["initContainerStatuses"] = [
        {"name": "wait-for-model", "ready": False, "restartCount": 0, "state": {"running": {}}}
    ]
    view = pod_view(waiting)
    assert view.failure is None and not view.hydration
    assert view.progress == "waiting for the model download to complete (wait-for-model running)"


def test_a_server_that_gave_up_loading_fails_the_target_with_its_own_line():
    failed = make_pod("t-a", ready=False, failure=pod_view(
        server_status(state={"terminated": {"exitCode": 3, "message": LOAD_FAILED_LINE}})
    ).failure)  # fmt: skip
    loading = make_pod("t-b", ready=False, progress="waiting for the model download to complete")
    status = compute_status(observe(pods=(failed, loading), probes={}), {}, T0)
    ready = condition(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ModelLoadFailed")
    assert ready["message"].startswith(f"pod t-a: {LOAD_FAILED_LINE} (container server exited")
    assert status["lastFailure"]["reason"] == "ModelLoadFailed" and status["phase"] == "Failed"
    events = transitions({}, status)
    assert [(e.type, e.reason) for e in events] == [
        ("Warning", "ModelLoadFailed"),
        ("Warning", "ModelLoadFailed"),
        ("Warning", "ModelLoadFailed"),
    ][: len(events)]
    assert sum(e.message.startswith("Ready=False") for e in events) == 1


def test_progressing_shows_how_far_each_loading_pod_has_come():
    pods = (make_pod("t-a", ready=False), make_pod("t-b", ready=False, progress="downloading the model"))
    probes = {
        "t-a": ProbeResult(False, error="/readyz answered 503", progress="loading weights 120/291 tensors"),
        "t-b": ProbeResult(False, error="not probed yet"),
    }
    status = compute_status(observe(pods=pods, probes=probes), {}, T0)
    progressing = condition(status, "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("True", "Loading")
    assert progressing["message"] == (
        "0/2 replicas serving; loading; t-a: loading weights 120/291 tensors; t-b: downloading the model"
    )


def test_deployment_view_reads_replica_failure():
    deployment = {
        "metadata": {"generation": 4},
        "spec": {"replicas": 2},
        "status": {
            "observedGeneration": 3,
            "replicas": 1,
            "conditions": [{"type": "ReplicaFailure", "status": "True", "message": "exceeded quota"}],
        },
    }
    view = deployment_view(deployment)
    assert (view.generation, view.observed_generation, view.desired, view.replicas) == (4, 3, 2, 1)
    assert view.failure == Failure("ReplicaFailure", "exceeded quota")


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
    crd = yaml.safe_load(CRD.read_text())
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


SOURCE = "org/tiny@main into claim hf-cache"


def hydration_pod(name: str, **overrides: Any) -> PodView:
    return make_pod(name, ready=False, hydration=True, **overrides)


def test_a_running_download_is_progressing_with_files_and_bytes_done():
    progress = describe_progress(
        HydrationProgress(files_done=3, files_total=17, bytes_done=4_200_000_000, bytes_total=16_100_000_000)
    )
    assert progress == "3/17 files, 4.2 of 16.1 GB"
    running = hydration_state(
        SOURCE, JobView("j", complete=False, failure=None), [hydration_pod("j-1")], progress
    )
    status = compute_status(observe(pods=(), probes={}, deployment=None, hydration=running), {}, T0)
    for kind in ("Ready", "Progressing"):
        assert condition(status, kind)["reason"] == "Downloading"
        assert condition(status, kind)["message"] == f"downloading {SOURCE}: 3/17 files, 4.2 of 16.1 GB"
    assert condition(status, "Progressing")["status"] == "True"
    assert condition(status, "Degraded")["status"] == "False"
    assert status["phase"] == "Pending" and status["readyDesired"] == "0/2"
    unknown = hydration_state(SOURCE, None, [], None)  # the Job is being created: no numbers yet
    status = compute_status(observe(pods=(), probes={}, deployment=None, hydration=unknown), {}, T0)
    assert condition(status, "Progressing")["message"] == f"downloading {SOURCE}"
    assert describe_progress(HydrationProgress()) is None


def test_a_failed_download_reports_the_attempts_own_reason():
    said = Failure(
        "ModelDownloadFailed", "org/tiny@main: gated repository (container download-model exited 2)"
    )
    failed_job = JobView("j", complete=False, failure=Failure("ModelDownloadFailed", "PodFailurePolicy: x"))
    pods = [hydration_pod("j-1", finished=True, failure=said, created=T0)]
    state = hydration_state(SOURCE, failed_job, pods, None)
    assert state.failure == said
    status = compute_status(observe(pods=(), probes={}, deployment=None, hydration=state), {}, T0)
    assert condition(status, "Ready")["reason"] == "ModelDownloadFailed"
    assert condition(status, "Degraded")["status"] == "True"
    assert status["phase"] == "Failed" and status["lastFailure"]["message"] == said.message
    assert [e.type for e in transitions({}, status)] == ["Warning"]
    # Without a pod that said why, the Job's own condition is the reason.
    assert hydration_state(SOURCE, failed_job, [], None).failure == failed_job.failure


def test_a_retried_attempt_is_not_a_failure_but_a_stuck_pod_is():
    earlier = hydration_pod("j-1", finished=True, failure=Failure("ModelDownloadFailed", "reset by peer"))
    retrying = hydration_state(SOURCE, JobView("j", False, None), [earlier, hydration_pod("j-2")], None)
    assert retrying.failure is None and not retrying.complete
    stuck = hydration_pod("j-3", failure=Failure("CreateContainerConfigError", 'secret "hf" not found'))
    state = hydration_state(SOURCE, JobView("j", False, None), [earlier, stuck], None)
    assert state.failure == Failure("CreateContainerConfigError", 'hydration pod j-3: secret "hf" not found')


def test_a_complete_download_leaves_status_to_the_server_pods():
    done = hydration_state(SOURCE, JobView("j", complete=True, failure=None), [], None)
    assert done.complete
    status = compute_status(observe(hydration=done), {}, T0)
    assert condition(status, "Ready")["reason"] == "AllReplicasReady"


def test_old_pods_keep_serving_while_a_new_revision_downloads():
    running = hydration_state(SOURCE, JobView("j", False, None), [hydration_pod("j-1")], None)
    status = compute_status(observe(hydration=running), {}, T0)
    assert condition(status, "Ready")["reason"] == "Downloading"
    assert status["readyReplicas"] == 2 and [e["ready"] for e in status["endpoints"]] == [True, True]


MODEL = ("--model", "/models/tiny", "--engine", "hf", "--model-name", "tiny-llama")
OTHER_MODEL = (
    "--model",
    "/models/tiny",
    "--engine",
    "hf",
    "--model-name",
    "tiny-llama",
    "--dtype",
    "float16",
)


def test_scale_up_keeps_the_target_available_while_not_ready():
    """Two replicas serve, a third loads: Ready (all desired replicas) is False, Available is True."""
    pods = (make_pod("t-a"), make_pod("t-b", "127.1.0.6"), make_pod("t-c", "127.1.0.7", ready=False))
    probes = {"t-a": ProbeResult(True, INFO), "t-b": ProbeResult(True, INFO)}
    obs = observe(
        spec=make_spec(replicas=3),
        pods=pods,
        probes=probes,
        deployment=make_deployment(desired=3, replicas=3, updated_replicas=3),
    )
    status = compute_status(obs, {}, T0)
    assert (condition(status, "Ready")["status"], condition(status, "Ready")["reason"]) == (
        "False",
        "Loading",
    )
    available = condition(status, "Available")
    assert (available["status"], available["reason"]) == ("True", "Serving")
    assert "2/3" in available["message"] and "sha256:aaaa" in available["message"]
    assert [e["ready"] for e in status["endpoints"]] == [True, True, False]


def test_rollout_that_keeps_the_model_stays_available_one_that_changes_it_does_not():
    """Old pods of a rollout serve the current generation's model when their model-deciding flags match."""
    old = make_pod("t-a", identity=MODEL)
    new_loading = make_pod("t-b", "127.1.0.6", ready=False, identity=MODEL)
    rolling = make_deployment(generation=2, observed_generation=2, updated_replicas=1)
    probes = {"t-a": ProbeResult(True, INFO)}
    keeps = compute_status(
        observe(pods=(old, new_loading), probes=probes, deployment=rolling, identity=MODEL), {}, T0
    )
    assert condition(keeps, "Ready")["reason"] == "RollingOut"
    assert condition(keeps, "Available")["status"] == "True"
    assert keeps["endpoints"][0]["ready"] and keeps["model"]["fingerprint"] == "sha256:aaaa"

    changes = compute_status(
        observe(pods=(old, new_loading), probes=probes, deployment=rolling, identity=OTHER_MODEL), {}, T0
    )
    assert condition(changes, "Available")["status"] == "False"
    assert not any(e["ready"] for e in changes["endpoints"])  # a job never lands on the old model
    assert changes["model"] is None and changes["readyReplicas"] == 0


def test_unschedulable_replica_leaves_the_target_available():
    stuck = make_pod("t-b", ip=None, node=None, ready=False, failure=Failure("Unschedulable", "no GPUs"))
    obs = observe(pods=(make_pod("t-a"), stuck), probes={"t-a": ProbeResult(True, INFO)})
    status = compute_status(obs, {}, T0)
    assert condition(status, "Ready")["reason"] == "Unschedulable"
    assert condition(status, "Degraded")["status"] == "True"
    assert condition(status, "Available")["status"] == "True"
    assert status["phase"] == "Degraded"


def test_refused_apply_is_reported_with_its_reason_and_message():
    refused = Failure("QuotaExceeded", "deployments.apps is forbidden: exceeded quota: gpu-quota")
    served = compute_status(observe(apply_failure=refused), {}, T0)
    for kind, expected in (("Ready", "False"), ("Progressing", "False"), ("Degraded", "True")):
        assert (condition(served, kind)["status"], condition(served, kind)["reason"]) == (
            expected,
            "QuotaExceeded",
        )
    assert "exceeded quota" in condition(served, "Ready")["message"]
    assert condition(served, "Available")["status"] == "True"  # the pods there still serve
    assert served["lastFailure"]["reason"] == "QuotaExceeded"
    nothing = compute_status(observe(apply_failure=refused, pods=(), probes={}), {}, T0)
    assert (nothing["phase"], condition(nothing, "Available")["status"]) == ("Failed", "False")


def test_disagreeing_fingerprints_are_not_available():
    other = INFO.model_copy(update={"fingerprint": "sha256:bbbb"})
    obs = observe(
        probes={"t-a": ProbeResult(True, INFO), "t-b": ProbeResult(True, other)},
        deployment=make_deployment(generation=2, observed_generation=1),
    )
    status = compute_status(obs, {}, T0)
    assert condition(status, "Degraded")["reason"] == "FingerprintMismatch"
    assert condition(status, "Available")["status"] == "False"


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
