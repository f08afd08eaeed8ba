"""The server pods' Deployment and disruption budget: GPUs, probes, volumes, pod settings, scheduling,
rollout, suspend and the budget for several replicas."""

import pytest
from eagle3_operator.constants import SCRATCH_MOUNT
from eagle3_operator.render.names import selector_labels
from eagle3_operator.render.server_image import DEFAULT_IMAGE
from eagle3_operator.spec_pod_settings import GPU_RESOURCE

from support.rendering import (
    children,
    flag,
    make_spec,
    pod_of,
    server_of,
)


def test_auth_secret_is_mounted_where_the_flag_points():
    spec = make_spec(auth={"tokenSecretRef": {"name": "target-token"}})
    pod, server = pod_of(spec), server_of(spec)
    volume = next(v for v in pod["volumes"] if v["name"] == "auth")
    assert volume["secret"] == {"secretName": "target-token"}
    mount = next(m for m in server["volumeMounts"] if m["name"] == "auth")
    assert mount["readOnly"] is True
    assert flag(server["command"], "--auth-token-file") == f"{mount['mountPath']}/token"


@pytest.mark.parametrize(("engine", "gpus"), [("vllm", 1), ("vllm", 4), ("hf", 1), ("hf", 0)])
def test_gpus_follow_tensor_parallel_size(engine, gpus):
    spec = make_spec(
        engine=engine, tensorParallelSize=gpus, resources={"requests": {"cpu": "2", "memory": "8Gi"}}
    )
    resources = server_of(spec)["resources"]
    assert resources["requests"]["cpu"] == "2" and resources["requests"]["memory"] == "8Gi"
    if gpus:
        assert resources["requests"]["nvidia.com/gpu"] == gpus == resources["limits"]["nvidia.com/gpu"]
    else:
        assert "nvidia.com/gpu" not in resources["requests"]
        assert set(resources["limits"]) == {"ephemeral-storage"}


@pytest.mark.parametrize("timeout", [30, 95, 1800, 86400])
def test_startup_probe_budget_is_the_startup_timeout(timeout):
    server = server_of(make_spec(startupTimeoutSeconds=timeout))
    startup = server["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert timeout <= budget < timeout + startup["periodSeconds"]
    assert startup["httpGet"] == {"path": "/readyz", "port": "http"}
    assert server["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert server["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}


def test_a_failed_start_reports_its_termination_message_or_its_log_tail():
    server = server_of(make_spec())
    assert server["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert "terminationMessagePath" not in server  # the default, /dev/termination-log, is where it writes


@pytest.mark.parametrize(("fields", "size"), [({}, "16Gi"), ({"shmSize": "64Gi"}, "64Gi")])
def test_shared_memory_is_memory_backed_and_bounded(fields, size):
    spec = make_spec(**fields)
    pod, server = pod_of(spec), server_of(spec)
    shm = next(m for m in server["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = next(v for v in pod["volumes"] if v["name"] == shm["name"])
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": size}


def test_pod_settings_reach_the_pod_template():
    spec = make_spec(
        env=[
            {"name": "NCCL_DEBUG", "value": "INFO"},
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hub", "key": "token"}}},
        ],
        volumes=[{"name": "nvme", "hostPath": {"path": "/mnt/nvme", "type": "Directory"}}],
        volumeMounts=[{"name": "nvme", "mountPath": "/cache/vllm", "readOnly": False}],
        podMetadata={
            "labels": {"kueue.x-k8s.io/queue-name": "gpu-queue"},
            "annotations": {"sidecar.istio.io/inject": "false"},
        },
        runtimeClassName="nvidia",
        serviceAccountName="bucket-reader",
        schedulerName="volcano",
    )
    template = children(spec)["Deployment"]["spec"]["template"]
    pod, server = template["spec"], template["spec"]["containers"][0]
    assert server["env"] == [
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "HOME", "value": SCRATCH_MOUNT},
        {"name": "TMPDIR", "value": SCRATCH_MOUNT},
        {"name": "NCCL_DEBUG", "value": "INFO"},
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hub", "key": "token"}}},
    ]
    assert {"name": "nvme", "hostPath": {"path": "/mnt/nvme", "type": "Directory"}} in pod["volumes"]
    assert {"name": "nvme", "mountPath": "/cache/vllm", "readOnly": False} in server["volumeMounts"]
    assert [v["name"] for v in pod["volumes"]] == ["model", "dshm", "scratch", "nvme"]
    assert template["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert selector_labels("tiny").items() <= template["metadata"]["labels"].items()
    assert template["metadata"]["annotations"] == {
        "sidecar.istio.io/inject": "false",
        "kubectl.kubernetes.io/default-container": "server",
    }
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["serviceAccountName"] == pod["serviceAccount"] == "bucket-reader"
    assert pod["automountServiceAccountToken"] is False  # a cloud identity needs no Kubernetes API token
    assert pod["schedulerName"] == "volcano"


def test_unset_pod_settings_leave_no_trace():
    pod = pod_of(make_spec())
    for absent in (
        "runtimeClassName",
        "serviceAccountName",
        "serviceAccount",
        "schedulerName",
        "topologySpreadConstraints",
    ):
        assert absent not in pod
    assert [e["name"] for e in pod["containers"][0]["env"]] == ["HF_HUB_OFFLINE", "HOME", "TMPDIR"]


def test_the_root_filesystem_is_read_only_and_scratch_is_an_emptydir():
    """Everything the server writes goes to the scratch emptyDir (HOME, TMPDIR) or /dev/shm, bounded by an
    ephemeral-storage request and limit the spec can override."""
    pod = pod_of(make_spec())
    (server,) = pod["containers"]
    assert server["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "scratch", "emptyDir": {}} in pod["volumes"]
    assert {"name": "scratch", "mountPath": SCRATCH_MOUNT} in server["volumeMounts"]
    assert server["resources"]["requests"]["ephemeral-storage"] == "1Gi"
    assert server["resources"]["limits"]["ephemeral-storage"] == "20Gi"
    own = make_spec(resources={"limits": {"ephemeral-storage": "200Gi", "memory": "8Gi"}})
    assert server_of(own)["resources"]["limits"] == {
        "ephemeral-storage": "200Gi",
        "memory": "8Gi",
        GPU_RESOURCE: 1,
    }


def test_topology_spread_defaults_to_this_targets_pods():
    own = {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}
    other = {
        "maxSkew": 2,
        "topologyKey": "topology.kubernetes.io/zone",
        "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": {"matchExpressions": [{"key": "team", "operator": "Exists"}]},
        "minDomains": 2,
    }
    spread = pod_of(make_spec(topologySpreadConstraints=[own, other]))["topologySpreadConstraints"]
    assert spread == [
        {**own, "labelSelector": {"matchLabels": selector_labels("tiny")}},
        {**other, "labelSelector": {"matchExpressions": [{"key": "team", "operator": "Exists"}]}},
    ]


def test_scheduling_fields_are_copied_into_the_pod():
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}
    spec = make_spec(
        nodeSelector={"nvidia.com/gpu.product": "H100"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        affinity=affinity,
        priorityClassName="training-high",
        imagePullSecrets=[{"name": "registry"}],
        image="registry.example/eagle3-target:dev",
    )
    pod = pod_of(spec)
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["affinity"] == affinity
    assert pod["priorityClassName"] == "training-high"
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    assert pod["containers"][0]["image"] == "registry.example/eagle3-target:dev"
    assert server_of(make_spec())["image"] == DEFAULT_IMAGE


def test_metrics_have_a_port_of_their_own():
    server = server_of(make_spec(monitoring={"metricsPort": 9400}))
    assert server["ports"][1] == {"name": "metrics", "containerPort": 9400, "protocol": "TCP"}
    assert flag(server["command"], "--metrics-port") == "9400"
    assert flag(server_of(make_spec())["command"], "--metrics-port") == "9090"


def test_rollout_never_needs_extra_gpus_by_default():
    deployment = children(make_spec(replicas=3))["Deployment"]
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }


def test_rollout_follows_the_spec():
    spec = make_spec(replicas=4, rollout={"maxSurge": "25%", "maxUnavailable": 0})
    rolling = children(spec)["Deployment"]["spec"]["strategy"]["rollingUpdate"]
    assert rolling == {"maxSurge": "25%", "maxUnavailable": 0}


def test_suspend_scales_to_zero_and_drops_the_budget():
    rendered = children(make_spec(replicas=3, suspend=True))
    assert rendered["Deployment"]["spec"]["replicas"] == 0
    assert "PodDisruptionBudget" not in rendered


@pytest.mark.parametrize(("replicas", "has_pdb"), [(0, False), (1, False), (2, True), (5, True)])
def test_disruption_budget_only_for_several_replicas(replicas, has_pdb):
    rendered = children(make_spec(replicas=replicas))
    assert ("PodDisruptionBudget" in rendered) is has_pdb
    if has_pdb:
        pdb = rendered["PodDisruptionBudget"]["spec"]
        assert pdb["maxUnavailable"] == 1
        assert pdb["selector"] == {"matchLabels": selector_labels("tiny")}
        assert pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
