"""resolve() against a real kube-apiserver: the test plays the operator by writing status itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import kubernetes
import pytest
from eagle3_target.client import (
    ResolvedTarget,
    ResolveError,
    ResolveTimeout,
    TargetAccessForbidden,
    TargetCRDMissing,
    TargetNotFound,
    resolve,
)
from eagle3_target.client.resolve import TargetResource, readiness
from eagle3_target.protocol import ANNOTATION_WAKE_REQUESTED, GROUP, PLURAL, VERSION

from support.cluster.waiting import eventually, free_port
from support.targets import MODEL_STATUS, create_target, target_status, wake_annotation, write_status

# status.idle as the operator writes it (no wake annotation when it went idle).
IDLE = {"idle": {"since": "2026-01-01T00:00:00Z"}}


def still_waiting(thread: threading.Thread) -> bool:
    """A correct resolve() never returns on a status that is not Ready for the current generation."""
    thread.join(timeout=0.5)
    return thread.is_alive()


def test_waits_through_progressing_and_stale_status_to_ready(cluster, namespace, objects):
    create_target(objects, namespace, "tiny")
    write_status(objects, namespace, "tiny", target_status(1, "False", "ModelLoading"))
    # Bump the generation: from now on, a status written for generation 1 is stale.
    objects.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "tiny", {"spec": {"replicas": 2}}
    )
    results: list[ResolvedTarget | BaseException] = []

    def run() -> None:
        try:
            results.append(resolve("tiny", namespace, wait=60, kubeconfig=str(cluster.kubeconfig)))
        except BaseException as exc:
            results.append(exc)

    waiter = threading.Thread(target=run)
    waiter.start()
    assert still_waiting(waiter)
    write_status(
        objects, namespace, "tiny", target_status(1, "True", "Serving", port=1111)
    )  # Ready, but for gen 1
    assert still_waiting(waiter)
    write_status(
        objects, namespace, "tiny", target_status(2, "True", "Serving", ready_generation=1, port=2222)
    )
    assert still_waiting(waiter)
    write_status(objects, namespace, "tiny", target_status(2, "False", "RollingUpdate", port=3333))
    assert still_waiting(waiter)
    write_status(objects, namespace, "tiny", target_status(2, "True", "Serving", port=4444))
    waiter.join(timeout=60)
    [target] = results
    assert isinstance(target, ResolvedTarget), target
    assert (target.name, target.namespace, target.generation) == ("tiny", namespace, 2)
    assert target.endpoints == ("http://127.0.0.2:4444",)  # the not-ready pod is left out
    assert target.url == "http://tiny.ns.svc:4444"
    assert target.urls == target.endpoints
    assert target.fingerprint == "fp-123"
    assert target.model is not None and target.model.aux_layer_ids == [1, 3, 4]
    # A status from before capture sets has none: its servers captured the aux layers alone.
    assert "captureLayerIds" not in MODEL_STATUS and target.model.capture_layer_ids == [1, 3, 4]
    assert target.model.num_hidden_layers == 8


def test_timeout_names_the_last_reason(cluster, namespace, objects):
    create_target(objects, namespace, "slow")
    write_status(objects, namespace, "slow", target_status(1, "False", "ModelLoading"))
    with pytest.raises(ResolveTimeout, match="ModelLoading"):
        resolve("slow", namespace, wait=1, kubeconfig=str(cluster.kubeconfig))
    objects.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "slow", {"spec": {"replicas": 3}}
    )
    with pytest.raises(ResolveTimeout, match="stale"):
        resolve("slow", namespace, wait=0, kubeconfig=str(cluster.kubeconfig))


def test_missing_resource(cluster, namespace, objects):
    with pytest.raises(TargetNotFound, match="'absent' not found"):
        resolve("absent", namespace, wait=5, kubeconfig=str(cluster.kubeconfig))


def test_missing_crd(cluster, namespace, objects):
    with pytest.raises(TargetCRDMissing, match="CRD installed"):
        resolve(
            "t", namespace, resource=TargetResource(group="absent.eagle3.dev"), api_client=cluster.api_client
        )
    with pytest.raises(TargetCRDMissing):
        resolve(
            "t", namespace, resource=TargetResource(plural="absenttargets"), api_client=cluster.api_client
        )


def test_unreachable_api_server_is_a_resolve_error():
    """A training job whose API server is down gets a readable ResolveError, not urllib3's traceback."""
    configuration = kubernetes.client.Configuration()
    configuration.host = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ResolveError, match="cannot reach the Kubernetes API server") as raised:
        resolve("t", "ns", wait=0, api_client=kubernetes.client.ApiClient(configuration))
    assert type(raised.value) is ResolveError  # not one of the classes that name a cause on the cluster


def test_forbidden(cluster, namespace, objects, tmp_path):
    create_target(objects, namespace, "secret")
    core = kubernetes.client.CoreV1Api(cluster.api_client)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "trainer"}})
    kubeconfig = cluster.write_service_account_kubeconfig(namespace, "trainer", tmp_path / "kubeconfig")
    with pytest.raises(TargetAccessForbidden, match="system:serviceaccount"):
        resolve("secret", wait=0, kubeconfig=str(kubeconfig))  # namespace from the kubeconfig context


def test_deleted_while_waiting(cluster, namespace, objects):
    create_target(objects, namespace, "gone")
    errors: list[BaseException] = []

    def run() -> None:
        try:
            resolve("gone", namespace, wait=60, kubeconfig=str(cluster.kubeconfig))
        except BaseException as exc:
            errors.append(exc)

    waiter = threading.Thread(target=run)
    waiter.start()
    assert still_waiting(waiter)
    objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "gone")
    waiter.join(timeout=60)
    [error] = errors
    assert isinstance(error, TargetNotFound)


def test_cli_prints_json_and_urls(cluster, namespace, objects):
    create_target(objects, namespace, "tiny")
    capturing = MODEL_STATUS | {"captureLayerIds": [7, 1, 3, 4]}
    write_status(
        objects, namespace, "tiny", target_status(1, "True", "Serving", port=5555) | {"model": capturing}
    )
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    cli = [
        str(Path(sys.executable).parent / "eagle3-target"),
        "resolve",
        "tiny",
        "-n",
        namespace,
        "--wait",
        "10",
    ]
    as_json = subprocess.run([*cli, "-o", "json"], capture_output=True, text=True, env=env, check=True)
    printed = json.loads(as_json.stdout)
    assert printed["endpoints"] == ["http://127.0.0.2:5555"]
    assert printed["fingerprint"] == "fp-123"
    assert printed["model"]["vocab_size"] == 256
    assert (printed["model"]["aux_layer_ids"], printed["model"]["capture_layer_ids"]) == (
        [1, 3, 4],
        [7, 1, 3, 4],
    )
    as_urls = subprocess.run([*cli, "-o", "urls"], capture_output=True, text=True, env=env, check=True)
    assert as_urls.stdout.split() == ["http://127.0.0.2:5555"]
    missing = subprocess.run(
        [*cli[:2], "absent", "-n", namespace, "--wait", "0"], capture_output=True, text=True, env=env
    )
    assert missing.returncode != 0
    assert "'absent' not found" in missing.stderr
    assert "Traceback" not in missing.stderr


@pytest.mark.parametrize(
    ("obj", "ready", "why"),
    [
        ({"metadata": {"generation": 1}}, False, "no Ready condition"),
        (
            {"metadata": {"generation": 2}, "status": target_status(1, "True", "Serving")},
            False,
            "observedGeneration=1",
        ),
        (
            {
                "metadata": {"generation": 2},
                "status": target_status(2, "True", "Serving", ready_generation=1),
            },
            False,
            "Ready condition is stale",
        ),
        (
            {"metadata": {"generation": 2}, "status": target_status(2, "False", "CrashLoopBackOff")},
            False,
            "CrashLoopBackOff",
        ),
        (
            {
                "metadata": {"generation": 2},
                "status": target_status(2, "True", "Serving") | {"url": None, "endpoints": []},
            },
            False,
            "neither status.url",
        ),
        (
            {"metadata": {"generation": 2}, "status": target_status(2, "True", "Serving") | IDLE},
            False,
            "idle since 2026-01-01T00:00:00Z",
        ),
        ({"metadata": {"generation": 2}, "status": target_status(2, "True", "Serving")}, True, "Serving"),
    ],
)
def test_readiness_rules(obj, ready, why):
    got_ready, got_why = readiness(obj)
    assert got_ready is ready
    assert why in got_why


def with_available(body: dict, available: str, reason: str, generation: int) -> dict:
    conditions = body["status"]["conditions"] + [
        {"type": "Available", "status": available, "reason": reason, "observedGeneration": generation}
    ]
    return body | {"status": body["status"] | {"conditions": conditions}}


SCALING_UP = with_available(
    {"metadata": {"generation": 2}, "status": target_status(2, "False", "Loading")}, "True", "Serving", 2
)


@pytest.mark.parametrize(
    ("obj", "require", "ready", "why"),
    [
        (SCALING_UP, "Available", True, "Available=True"),  # a scale-up: some endpoints serve
        (SCALING_UP, "Ready", False, "Loading"),  # require="Ready" still waits for all replicas
        (
            with_available(
                {"metadata": {"generation": 2}, "status": target_status(2, "False", "Loading")},
                "True",
                "Serving",
                1,
            ),
            "Available",
            False,
            "Available condition is stale",
        ),
        (
            with_available(
                {"metadata": {"generation": 2}, "status": target_status(2, "False", "Unschedulable")},
                "False",
                "Unschedulable",
                2,
            ),
            "Available",
            False,
            "Unschedulable",
        ),
        # An operator that publishes no Available condition is held to Ready.
        (
            {"metadata": {"generation": 2}, "status": target_status(2, "False", "Loading")},
            "Available",
            False,
            "Ready=",
        ),
    ],
)
def test_available_rules(obj, require, ready, why):
    got_ready, got_why = readiness(obj, require)
    assert got_ready is ready
    assert why in got_why


def test_resolve_returns_a_serving_target_at_once_and_waits_for_ready_only_when_asked(
    cluster, namespace, objects
):
    generation = create_target(objects, namespace, "growing")["metadata"]["generation"]
    serving = with_available(
        {"metadata": {}, "status": target_status(generation, "False", "Loading")},
        "True",
        "Serving",
        generation,
    )
    write_status(objects, namespace, "growing", serving["status"])
    found = resolve("growing", namespace, wait=0, kubeconfig=str(cluster.kubeconfig))
    assert found.endpoints == ("http://127.0.0.2:8000",)  # only the serving endpoint
    with pytest.raises(ResolveTimeout, match="not Ready after 1s"):
        resolve("growing", namespace, wait=1, kubeconfig=str(cluster.kubeconfig), require="Ready")
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    cli = [str(Path(sys.executable).parent / "eagle3-target"), "resolve", "growing", "-n", namespace]
    as_urls = subprocess.run([*cli, "-o", "urls"], capture_output=True, text=True, env=env, check=True)
    assert as_urls.stdout.split() == ["http://127.0.0.2:8000"]
    strict = subprocess.run([*cli, "--require", "Ready"], capture_output=True, text=True, env=env)
    assert strict.returncode != 0 and "not Ready" in strict.stderr


def test_resolve_sets_the_wake_annotation_of_an_idle_target_unless_told_not_to(cluster, namespace, objects):
    """The CLI plays a training job against a target the operator has scaled to zero for idleness."""
    create_target(objects, namespace, "idle")
    status = target_status(1, "False", "Idle") | {"idle": {"since": "2026-01-01T00:00:00Z"}}
    write_status(objects, namespace, "idle", status)

    def cli(*flags: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "eagle3_target.cli", "resolve", "idle", "-n", namespace, *flags]
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)

    def annotation() -> str | None:
        return wake_annotation(objects, namespace, "idle")

    refused = cli("--no-wake")
    assert refused.returncode == 1 and "reason='Idle'" in refused.stderr and "from idle" not in refused.stderr
    assert annotation() is None
    woken = cli("--wait", "1")
    assert (
        woken.returncode == 1 and "woken from idle, waiting for scheduling and a model load" in woken.stderr
    )
    first = annotation()
    assert first is not None
    cli("--wait", "0")
    assert annotation() == first  # asked once per wake
    # The operator woke it and it idled again, recording the annotation it had then.
    write_status(
        objects,
        namespace,
        "idle",
        status | {"idle": {"since": "2026-01-02T00:00:00Z", "wakeRequestedAt": first}},
    )
    cli("--wait", "0")
    assert annotation() not in (None, first)  # each wake is a new value, whatever the clocks say


def wake_writes(objects, namespace: str, name: str, since: str) -> int:
    """How many times the wake annotation changed after resourceVersion `since` (a watch replays them)."""
    changes, last = 0, None
    for event in kubernetes.watch.Watch().stream(
        objects.list_namespaced_custom_object,
        GROUP,
        VERSION,
        namespace,
        PLURAL,
        field_selector=f"metadata.name={name}",
        resource_version=since,
        timeout_seconds=1,
    ):
        value = (event["object"]["metadata"].get("annotations") or {}).get(ANNOTATION_WAKE_REQUESTED)
        changes += value != last
        last = value
    return changes


def test_every_rank_retrying_at_once_writes_the_wake_annotation_once_per_wake(cluster, namespace, objects):
    """Eight ranks meet the idle target together, and again on their retry before the operator acts: one
    write wakes it, the others see the wake asked for (or lose the conditional write) and wait."""
    create_target(objects, namespace, "shared")
    write_status(objects, namespace, "shared", target_status(1, "False", "Idle") | IDLE)
    since = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "shared")["metadata"][
        "resourceVersion"
    ]

    def all_ranks_resolve() -> None:
        start = threading.Barrier(8)
        outcomes: list[BaseException | ResolvedTarget] = []

        def rank() -> None:
            start.wait()
            try:
                outcomes.append(resolve("shared", namespace, wait=0, kubeconfig=str(cluster.kubeconfig)))
            except BaseException as exc:
                outcomes.append(exc)

        ranks = [threading.Thread(target=rank) for _ in range(8)]
        for thread in ranks:
            thread.start()
        for thread in ranks:
            thread.join(timeout=60)
        assert len(outcomes) == 8
        assert all(isinstance(o, ResolveTimeout) and "woken from idle" in str(o) for o in outcomes), outcomes

    all_ranks_resolve()
    assert wake_writes(objects, namespace, "shared", since) == 1
    all_ranks_resolve()  # their retries, the target still idle
    assert wake_writes(objects, namespace, "shared", since) == 1
    first = wake_annotation(objects, namespace, "shared")
    idle_again = {"idle": {"since": "2026-01-02T00:00:00Z", "wakeRequestedAt": first}}
    write_status(objects, namespace, "shared", target_status(1, "False", "Idle") | idle_again)
    all_ranks_resolve()
    assert wake_writes(objects, namespace, "shared", since) == 2


def test_a_target_going_idle_is_not_resolved_while_it_still_lists_ready_endpoints(
    cluster, namespace, objects
):
    """status.idle is written before the scale-down: its endpoints are on their way out."""
    create_target(objects, namespace, "draining")
    write_status(objects, namespace, "draining", target_status(1, "True", "Serving") | IDLE)
    with pytest.raises(ResolveTimeout, match="idle since"):
        resolve("draining", namespace, wait=0, kubeconfig=str(cluster.kubeconfig), wake=False)


def test_a_ready_waiter_wakes_a_target_that_idles_while_it_waits(cluster, namespace, objects):
    create_target(objects, namespace, "degraded")
    degraded = with_available(
        {"metadata": {}, "status": target_status(1, "False", "Degraded")}, "True", "Serving", 1
    )["status"]
    write_status(objects, namespace, "degraded", degraded)
    results: list[ResolvedTarget | BaseException] = []

    def run() -> None:
        try:
            results.append(
                resolve("degraded", namespace, wait=60, kubeconfig=str(cluster.kubeconfig), require="Ready")
            )
        except BaseException as exc:
            results.append(exc)

    waiter = threading.Thread(target=run)
    waiter.start()
    assert still_waiting(waiter)
    write_status(objects, namespace, "degraded", degraded | IDLE)
    eventually(
        lambda: wake_annotation(objects, namespace, "degraded"), "the waiter to wake the target", timeout=30
    )
    write_status(objects, namespace, "degraded", target_status(1, "True", "Serving") | {"idle": None})
    waiter.join(timeout=60)
    [target] = results
    assert isinstance(target, ResolvedTarget), target
    assert target.endpoints == ("http://127.0.0.2:8000",)
