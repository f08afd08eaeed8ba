"""The local control plane is a real one: the scheduler places GPU pods by allocatable, kwok runs them with
loopback IPs that answer on this machine, the garbage collector and namespace controller clean up, and the
API behaves for the Python client, kubectl, helm and ServiceAccount tokens as on any cluster."""

from __future__ import annotations

import http.server
import ipaddress
import json
import secrets
import threading
from pathlib import Path

import kubernetes
import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from support.cluster import nodes, plane
from support.cluster.access import Cluster
from support.cluster.waiting import direct_opener, eventually

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


def pods_of(cluster: Cluster, namespace: str, app: str) -> list[kubernetes.client.V1Pod]:
    core = kubernetes.client.CoreV1Api(cluster.api_client)
    return core.list_namespaced_pod(namespace, label_selector=f"app={app}").items


def ready_pods(cluster: Cluster, namespace: str, app: str, count: int) -> list[kubernetes.client.V1Pod]:
    def all_ready() -> list[kubernetes.client.V1Pod]:
        pods = pods_of(cluster, namespace, app)
        return pods if len(pods) == count and all(nodes.pod_ready(p) for p in pods) else []

    return eventually(all_ready, f"{count} Ready pods of {app}")


@pytest.fixture
def gpu_pods(cluster: Cluster, namespace: str) -> list[kubernetes.client.V1Pod]:
    """Two Ready pods of a Deployment that asks one GPU per pod."""
    apps = kubernetes.client.AppsV1Api(cluster.api_client)
    apps.create_namespaced_deployment(namespace, nodes.gpu_deployment("gpu", replicas=2, gpus=1))
    return ready_pods(cluster, namespace, "gpu", 2)


def test_gpu_nodes_offer_eight_gpus_and_loopback_pod_ranges(cluster: Cluster):
    core = kubernetes.client.CoreV1Api(cluster.api_client)
    for node in (core.read_node(nodes.gpu_node_name(index)) for index in range(2)):
        assert nodes.schedulable(node)
        assert node.metadata.labels["nvidia.com/gpu.product"] == nodes.GPU_PRODUCT
        assert node.status.allocatable[nodes.GPU_RESOURCE] == "8"
        assert ipaddress.ip_network(node.spec.pod_cidr).subnet_of(LOOPBACK)
        addresses = [a.address for a in node.status.addresses if a.type == "InternalIP"]
        assert addresses and all(ipaddress.ip_address(a) in LOOPBACK for a in addresses)


def test_gpu_pods_are_scheduled_on_gpu_nodes_and_run_with_loopback_ips(cluster: Cluster, gpu_pods):
    by_name = {n.metadata.name: n for n in kubernetes.client.CoreV1Api(cluster.api_client).list_node().items}
    for pod in gpu_pods:
        node = by_name[pod.spec.node_name]
        assert node.metadata.labels["nvidia.com/gpu.product"] == nodes.GPU_PRODUCT
        assert pod.status.phase == "Running"
        assert ipaddress.ip_address(pod.status.pod_ip) in ipaddress.ip_network(node.spec.pod_cidr)
        assert ipaddress.ip_address(pod.status.host_ip) in LOOPBACK
    assert len({p.status.pod_ip for p in gpu_pods}) == 2


def test_a_server_bound_at_a_pod_ip_answers_there(gpu_pods):
    pod = gpu_pods[0]

    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = f"{pod.metadata.name} at {self.server.server_address[0]}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    with http.server.ThreadingHTTPServer((pod.status.pod_ip, 0), Hello) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            url = f"http://{pod.status.pod_ip}:{server.server_address[1]}/"
            with direct_opener().open(url, timeout=10) as response:
                assert response.read().decode() == f"{pod.metadata.name} at {pod.status.pod_ip}"
        finally:
            server.shutdown()


def test_more_gpus_than_any_node_has_stays_pending_unschedulable(cluster: Cluster, namespace: str):
    apps = kubernetes.client.AppsV1Api(cluster.api_client)
    apps.create_namespaced_deployment(namespace, nodes.gpu_deployment("huge", replicas=1, gpus=9))

    def unschedulable() -> kubernetes.client.V1PodCondition | None:
        pods = pods_of(cluster, namespace, "huge")
        conditions = [c for p in pods for c in p.status.conditions or [] if c.type == "PodScheduled"]
        return next((c for c in conditions if c.status == "False"), None)

    condition = eventually(unschedulable, "PodScheduled=False")
    assert condition.reason == "Unschedulable"
    assert "Insufficient nvidia.com/gpu" in condition.message
    [pod] = pods_of(cluster, namespace, "huge")
    assert pod.status.phase == "Pending"
    assert pod.spec.node_name is None


def test_deleting_a_deployment_garbage_collects_its_pods(cluster: Cluster, namespace: str, gpu_pods):
    apps = kubernetes.client.AppsV1Api(cluster.api_client)
    assert apps.list_namespaced_replica_set(namespace).items
    apps.delete_namespaced_deployment("gpu", namespace)
    eventually(lambda: not pods_of(cluster, namespace, "gpu"), "the pods to be garbage-collected")
    assert apps.list_namespaced_replica_set(namespace).items == []


def test_deleting_a_namespace_with_running_pods_completes(cluster: Cluster):
    core = kubernetes.client.CoreV1Api(cluster.api_client)
    name = f"doomed-{secrets.token_hex(3)}"
    core.create_namespace(kubernetes.client.V1Namespace(metadata=kubernetes.client.V1ObjectMeta(name=name)))
    kubernetes.client.AppsV1Api(cluster.api_client).create_namespaced_deployment(
        name, nodes.gpu_deployment("x", 1, 1)
    )
    ready_pods(cluster, name, "x", 1)
    core.delete_namespace(name)

    def gone() -> bool:
        try:
            core.read_namespace(name)
        except ApiException as error:
            return error.status == 404
        return False

    eventually(gone, "the namespace to be deleted")


def test_services_get_loopback_cluster_ips(cluster: Cluster, namespace: str):
    core = kubernetes.client.CoreV1Api(cluster.api_client)
    service = core.create_namespaced_service(
        namespace,
        {
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80}]},
        },
    )
    assert ipaddress.ip_address(service.spec.cluster_ip) in ipaddress.ip_network(plane.SERVICE_CIDR)


def config_map(name: str, **data: str) -> dict[str, object]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}


def test_server_side_apply_tracks_owners_and_conflicts(cluster: Cluster, namespace: str):
    core = kubernetes.client.CoreV1Api(cluster.api_client)

    def apply(manager: str, body: dict[str, object], force: bool = False) -> kubernetes.client.V1ConfigMap:
        return core.patch_namespaced_config_map(
            "settings",
            namespace,
            body,
            field_manager=manager,
            force=force,
            _content_type="application/apply-patch+yaml",
        )

    apply("first", config_map("settings", color="blue"))
    with pytest.raises(ApiException) as conflict:
        apply("second", config_map("settings", color="red"))
    assert conflict.value.status == 409
    applied = apply("second", config_map("settings", color="red"), force=True)
    assert applied.data == {"color": "red"}
    assert {"second"} <= {entry.manager for entry in applied.metadata.managed_fields}


def test_watch_streams_changes_from_a_resource_version(cluster: Cluster, namespace: str):
    core = kubernetes.client.CoreV1Api(cluster.api_client)
    since = core.list_namespaced_config_map(namespace).metadata.resource_version
    core.create_namespaced_config_map(namespace, config_map("watched", step="1"))
    core.patch_namespaced_config_map("watched", namespace, {"data": {"step": "2"}})
    core.delete_namespaced_config_map("watched", namespace)

    seen = []
    watch = kubernetes.watch.Watch()
    for event in watch.stream(
        core.list_namespaced_config_map, namespace, resource_version=since, timeout_seconds=30
    ):
        if event["object"].metadata.name == "watched":
            seen.append((event["type"], event["object"].data))
        if len(seen) == 3:
            watch.stop()
    assert seen == [("ADDED", {"step": "1"}), ("MODIFIED", {"step": "2"}), ("DELETED", {"step": "2"})]


@pytest.fixture
def service_account(cluster: Cluster, namespace: str) -> str:
    core = kubernetes.client.CoreV1Api(cluster.api_client)
    return core.create_namespaced_service_account(namespace, {"metadata": {"name": "robot"}}).metadata.name


def test_service_account_tokens_authenticate_and_rbac_authorizes(
    cluster: Cluster, namespace, service_account, tmp_path
):
    config = cluster.write_service_account_kubeconfig(
        namespace, service_account, tmp_path / "robot.kubeconfig"
    )
    robot = Cluster(config, cluster.bin_dir)
    review = kubernetes.client.AuthenticationV1Api(robot.api_client).create_self_subject_review({})
    assert review.status.user_info.username == f"system:serviceaccount:{namespace}:{service_account}"

    robot_core = kubernetes.client.CoreV1Api(robot.api_client)
    with pytest.raises(ApiException) as forbidden:
        robot_core.list_namespaced_pod(namespace)
    assert forbidden.value.status == 403

    kubernetes.client.RbacAuthorizationV1Api(cluster.api_client).create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "robot-view"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "view"},
            "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}],
        },
    )
    eventually(
        lambda: robot.kubectl("auth", "can-i", "list", "pods", check=False).stdout.strip() == "yes", "RBAC"
    )
    assert robot_core.list_namespaced_pod(namespace).items == []
    assert robot.kubectl("auth", "can-i", "delete", "pods", check=False).stdout.strip() == "no"


def test_kubectl_matches_the_server_version(cluster: Cluster):
    versions = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    server = kubernetes.client.VersionApi(cluster.api_client).get_code().git_version
    assert versions["serverVersion"]["gitVersion"] == server
    assert versions["clientVersion"]["gitVersion"] == server


def probe_chart(directory: Path) -> Path:
    """A chart whose one ConfigMap records the Kubernetes version helm believes it deploys to."""
    (directory / "templates").mkdir(parents=True)
    (directory / "Chart.yaml").write_text(
        yaml.safe_dump({"apiVersion": "v2", "name": "probe", "version": "0.1.0"})
    )
    (directory / "templates" / "version.yaml").write_text(
        yaml.safe_dump(config_map("probe", kubeVersion="{{ .Capabilities.KubeVersion.Version }}"))
    )
    return directory


def test_helm_installs_a_chart_that_sees_the_server_version(cluster: Cluster, namespace: str, tmp_path):
    assert cluster.helm("version", "--template", "{{.Version}}").stdout.startswith("v3.")
    chart = probe_chart(tmp_path / "probe")
    server = kubernetes.client.VersionApi(cluster.api_client).get_code()

    offline = yaml.safe_load(cluster.helm("template", "probe", str(chart)).stdout)
    assert offline["data"]["kubeVersion"].startswith(
        f"v{server.major}.{server.minor}."
    )  # helm's built-in default

    cluster.helm("install", "probe", str(chart), "--namespace", namespace, "--wait", "--timeout", "60s")
    rendered = kubernetes.client.CoreV1Api(cluster.api_client).read_namespaced_config_map("probe", namespace)
    assert rendered.data["kubeVersion"] == server.git_version
    assert "probe" in cluster.helm("list", "--namespace", namespace, "--short").stdout.split()
