"""Reading pods, Jobs and Deployments into views: the failures a pod says about itself (scheduling, images,
a server or download that gave up, OOM kills), finished pods, and the model download from its Job and pods
to the status."""

from typing import Any

from eagle3_operator.status.conditions import transitions
from eagle3_operator.status.document import compute_status
from eagle3_operator.status.observation import Failure, JobView, PodView
from eagle3_operator.status.observe import deployment_view, describe_progress, hydration_state, pod_view
from eagle3_target.protocol import EXIT_ENGINE_FAILED, HydrationProgress

from support.observations import T0, make_pod, observe
from support.targets import condition


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


def test_pod_view_tells_a_server_whose_engine_died_from_one_that_could_not_load():
    """Exit 4: the engine it had loaded died (a rank or engine-core process gone, the device lost)."""
    line = "the engine failed: SGLang tensor-parallel rank 1 died (exit code -9)"
    terminated = {"exitCode": EXIT_ENGINE_FAILED, "reason": "Error", "message": line}
    view = pod_view(
        server_status(state={"running": {}}, lastState={"terminated": terminated}, restartCount=1)
    )
    assert view.failure == Failure(
        "EngineFailed", f"{line} (container server exited with code 4, 1 restarts)"
    )


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
