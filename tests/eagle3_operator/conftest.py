"""Operator test fixtures: the CRD installed, the operator running as a real process against the local control
plane, per-test namespaces it serves, and real target servers answering at the simulated pods' IPs.

Each module's operator serves only that module's namespaces (`e3op<module hash>-*`), so it never touches
resources of other test modules: neither their own operators' targets nor the leftovers of a module that ran
before it (namespaces are deleted asynchronously, their targets linger while they terminate).
"""

from __future__ import annotations

import functools
import hashlib
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import kubernetes
import pytest
from eagle3_target.protocol import API_VERSION, GROUP, PLURAL, VERSION

from support.cluster import nodes
from support.cluster.access import Cluster
from support.cluster.waiting import eventually, free_port
from support.kubelet import Kubelet
from support.operator_process import OperatorProcess
from support.server_farm import PodServing, ServerFarm
from support.targets import Targets


@pytest.fixture(scope="module")
def namespace_prefix(request: pytest.FixtureRequest) -> str:
    """The prefix of the namespaces this module's operator serves."""
    return f"e3op{hashlib.sha256(request.module.__name__.encode()).hexdigest()[:6]}-"


@pytest.fixture(scope="module")
def operator(
    cluster: Cluster,
    crd: None,
    namespace_prefix: str,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[OperatorProcess]:
    """This module's operator; it probes at OperatorProcess's pace unless the module sets REPROBE_SECONDS
    (None: the operator's own default)."""
    module = request.module
    pace = {"reprobe_seconds": module.REPROBE_SECONDS} if hasattr(module, "REPROBE_SECONDS") else {}
    process = OperatorProcess(
        cluster.kubeconfig, tmp_path_factory.mktemp("operator"), [f"{namespace_prefix}*"], **pace
    )
    process.start()
    try:
        _wait_until_new_namespaces_are_served(cluster, namespace_prefix)
        yield process
    finally:
        process.stop()
        print(f"operator logs: {process.log_dir}")


def _wait_until_new_namespaces_are_served(cluster: Cluster, prefix: str) -> None:
    """kopf misses a namespace created while its namespace watch is still starting (the watch lists again and
    drops what that listing returns), so the first test's namespace could go unserved until it is deleted.
    Wait until a namespace created now is served: a target in it gets a status (an unreachable external
    endpoint: one refused connection, then a status write)."""
    core = kubernetes.client.CoreV1Api(cluster.api_client)
    custom = kubernetes.client.CustomObjectsApi(cluster.api_client)
    for _ in range(5):
        name = f"{prefix}warmup-{secrets.token_hex(3)}"
        core.create_namespace(
            kubernetes.client.V1Namespace(metadata=kubernetes.client.V1ObjectMeta(name=name))
        )
        try:
            target = {
                "apiVersion": API_VERSION,
                "kind": "Eagle3Target",
                "metadata": {"name": "warmup"},
                "spec": {"model": {"name": "warmup"}, "endpoint": {"url": f"http://127.0.0.1:{free_port()}"}},
            }
            custom.create_namespaced_custom_object(GROUP, VERSION, name, PLURAL, target)
            read = functools.partial(
                custom.get_namespaced_custom_object, GROUP, VERSION, name, PLURAL, "warmup"
            )
            eventually(lambda read=read: read().get("status"), "the warm-up target's status", timeout=15)
            return
        except TimeoutError:
            continue  # created in the window: try a new namespace
        finally:
            core.delete_namespace(name)
    raise AssertionError("the operator does not serve namespaces created after it started")


@pytest.fixture
def op_namespace(make_namespace: Callable[[str], str], namespace_prefix: str) -> str:
    """A fresh namespace the module's operator serves, deleted afterwards."""
    return make_namespace(namespace_prefix)


@pytest.fixture
def targets(cluster: Cluster, op_namespace: str) -> Targets:
    return Targets(cluster, op_namespace)


@pytest.fixture
def pod_serving(targets: Targets, servers: ServerFarm) -> Iterator[PodServing]:
    with PodServing(targets.core, targets.namespace, servers) as serving:
        yield serving


@pytest.fixture(scope="module")
def kubelet_node(cluster: Cluster) -> str:
    """The node whose pods the test kubelet (or a test playing it) runs, registered once per session."""
    core = kubernetes.client.CoreV1Api(cluster.api_client)
    try:
        core.create_node(nodes.kubelet_node())
    except kubernetes.client.ApiException as error:
        if error.status != 409:  # already registered by an earlier module of this session
            raise
    eventually(lambda: nodes.all_schedulable(cluster.api_client, [nodes.KUBELET_NODE]), "the kubelet's node")
    return nodes.KUBELET_NODE


@pytest.fixture
def kubelet(cluster: Cluster, kubelet_node: str, op_namespace: str, tmp_path: Path) -> Iterator[Kubelet]:
    """The test kubelet running the server containers of the pods bound to its node in `op_namespace`."""
    runner = Kubelet(kubernetes.client.CoreV1Api(cluster.api_client), op_namespace, tmp_path)
    try:
        yield runner
    finally:
        runner.close()
