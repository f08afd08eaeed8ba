"""The rules, without a cluster: when Ready and Available are True, which reason explains a stall or a
failure, and what an external endpoint, an invalid spec or a suspended target report."""

from datetime import timedelta

from eagle3_operator.status.document import compute_status
from eagle3_operator.status.observation import Failure, Observation, ProbeResult
from eagle3_target.protocol import TargetInfo

from support.observations import INFO, T0, make_deployment, make_pod, make_spec, observe
from support.targets import condition


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


def test_the_model_shows_the_served_capture_set():
    """status.model.captureLayerIds from the servers' /v1/info; a server older than capture sets reports
    none and captured its aux layers alone."""
    # INFO's model as a server's /v1/info answers it.
    answer = INFO.model_dump(exclude={"name", "capture_layer_ids"}) | {
        "model": INFO.name,
        **{"formats": ["hidden"], "max_batch_tokens": 4096, "max_model_len": 512, "version": "0"},
    }
    for reported, capture in (({"capture_layer_ids": [2, 0, 1, 3]}, [2, 0, 1, 3]), ({}, [0, 1, 2])):
        served = TargetInfo.model_validate(answer | reported).served_model()
        probes = {"t-a": ProbeResult(True, served), "t-b": ProbeResult(True, served)}
        status = compute_status(observe(probes=probes), {}, T0)
        assert status["model"] == INFO.to_status() | {"captureLayerIds": capture}


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
