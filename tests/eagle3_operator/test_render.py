"""Rendering a target's children: field-level checks per source and option, name limits, and a server-side
dry run of the rendered objects against the real API server."""

import json
import re
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from eagle3_operator import render
from eagle3_operator.constants import OPERATOR_ENV
from eagle3_operator.spec import Eagle3TargetSpec
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.eagle3_operator.harness import POD_SETTINGS

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
UID = "0b6f7f4e-5a1c-4d53-9d0e-1f2a3b4c5d6e"
HF_SOURCE = {"huggingFace": {"repo": "org/tiny-model", "cacheClaimName": "hf-cache"}}


def make_spec(source: dict[str, Any] | None = None, **fields: Any) -> Eagle3TargetSpec:
    model = {"name": "org/tiny-model", "source": source or {"pvc": {"claimName": "models"}}}
    return Eagle3TargetSpec.parse({"model": model, **fields})


def children(
    spec: Eagle3TargetSpec, name: str = "tiny", namespace: str = "ml", **kwargs: Any
) -> dict[str, dict]:
    rendered = render.build_children(name, namespace, UID, spec, pod_monitor_supported=True, **kwargs)
    return {child["kind"]: child for child in rendered}


def pod_of(spec: Eagle3TargetSpec) -> dict[str, Any]:
    return children(spec)["Deployment"]["spec"]["template"]["spec"]


def server_of(spec: Eagle3TargetSpec) -> dict[str, Any]:
    (container,) = pod_of(spec)["containers"]
    return container


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_default_target_renders_deployment_and_service():
    rendered = children(make_spec())
    assert sorted(rendered) == ["Deployment", "Service"]
    for child in rendered.values():
        meta = child["metadata"]
        assert meta["name"] == "tiny" and meta["namespace"] == "ml"
        assert meta["ownerReferences"] == [render.owner_reference("tiny", UID)]
        assert meta["ownerReferences"][0]["controller"] is True
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "eagle3-operator"
    json.dumps(list(rendered.values()))  # server-side apply sends JSON


def test_selectors_pick_only_this_targets_pods():
    rendered = children(make_spec())
    deployment, service = rendered["Deployment"], rendered["Service"]
    selector = render.selector_labels("tiny")
    assert deployment["spec"]["selector"]["matchLabels"] == selector
    assert service["spec"]["selector"] == selector
    template_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= template_labels.items()
    assert render.selector_labels("tiny") != render.selector_labels("tiny2")
    assert (
        render.label_selector("tiny")
        == "app.kubernetes.io/instance=tiny,app.kubernetes.io/name=eagle3-target"
    )


def test_service_exposes_the_http_port():
    service = children(make_spec(port=9000))["Service"]
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"}
    ]
    assert server_of(make_spec(port=9000))["ports"][0] == {
        "name": "http",
        "containerPort": 9000,
        "protocol": "TCP",
    }
    assert render.service_url("tiny", "ml", make_spec(port=9000)) == "http://tiny.ml.svc:9000"


def test_server_command_line_follows_the_spec():
    spec = make_spec(
        {"pvc": {"claimName": "models"}},
        engine="vllm",
        tensorParallelSize=2,
        auxLayerIds=[2, 9, 5],
        maxModelLen=4096,
        engineArgs={"max-num-seqs": "8", "enforce-eager": "true", "gpu-memory-utilization": "0.85"},
        auth={"tokenSecretRef": {"name": "target-token", "key": "bearer"}},
    )
    command = server_of(spec)["command"]
    assert command[:2] == ["eagle3-target", "serve"]
    assert flag(command, "--model") == "/models"
    assert flag(command, "--engine") == "vllm"
    assert flag(command, "--port") == "8000"
    assert flag(command, "--tensor-parallel-size") == "2"
    assert flag(command, "--max-model-len") == "4096"
    assert flag(command, "--model-name") == "org/tiny-model"
    aux = command.index("--aux-layer-ids")
    assert command[aux + 1 : aux + 4] == ["2", "9", "5"]  # the requested order, which sets the concat order
    engine_args = [command[i + 1] for i, part in enumerate(command) if part == "--engine-arg"]
    assert engine_args == ["enforce-eager=true", "gpu-memory-utilization=0.85", "max-num-seqs=8"]
    assert flag(command, "--auth-token-file") == f"{render.AUTH_MOUNT}/bearer"
    assert "--trust-remote-code" not in command
    assert "--dtype" not in command and "--revision" not in command


def test_optional_flags_appear_only_when_set():
    spec = make_spec(engine="hf", tensorParallelSize=0)
    command = server_of(spec)["command"]
    for absent in (
        "--tensor-parallel-size",
        "--max-model-len",
        "--aux-layer-ids",
        "--engine-arg",
        "--auth-token-file",
    ):
        assert absent not in command
    model = {
        "name": "m",
        "revision": "abc123",
        "dtype": "bfloat16",
        "trustRemoteCode": True,
        "source": {"hostPath": {"path": "/m"}},
    }
    command = server_of(Eagle3TargetSpec.parse({"model": model, "engine": "hf"}))["command"]
    assert flag(command, "--dtype") == "bfloat16"
    assert flag(command, "--revision") == "abc123"
    assert command[-1] == "--trust-remote-code"


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
        assert "limits" not in resources


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


def test_pod_is_locked_down():
    pod, server = pod_of(make_spec()), server_of(make_spec())
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    assert pod["enableServiceLinks"] is False
    context = server["securityContext"]
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["runAsNonRoot"] is True


def test_pod_runs_as_the_target_images_user():
    dockerfile = (Path(__file__).resolve().parents[2] / "image" / "Dockerfile").read_text()
    (user,) = re.findall(r"^USER (\d+):(\d+)$", dockerfile, flags=re.MULTILINE)
    context = pod_of(make_spec())["securityContext"]
    assert (str(context["runAsUser"]), str(context["runAsGroup"])) == user


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
        {"name": "NCCL_DEBUG", "value": "INFO"},
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hub", "key": "token"}}},
    ]
    assert {"name": "nvme", "hostPath": {"path": "/mnt/nvme", "type": "Directory"}} in pod["volumes"]
    assert {"name": "nvme", "mountPath": "/cache/vllm", "readOnly": False} in server["volumeMounts"]
    assert [v["name"] for v in pod["volumes"]] == ["model", "dshm", "nvme"]
    assert template["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert render.selector_labels("tiny").items() <= template["metadata"]["labels"].items()
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
    assert [e["name"] for e in pod["containers"][0]["env"]] == ["HF_HUB_OFFLINE"]


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
        {**own, "labelSelector": {"matchLabels": render.selector_labels("tiny")}},
        {**other, "labelSelector": {"matchExpressions": [{"key": "team", "operator": "Exists"}]}},
    ]


def test_ids_are_the_images_unless_set_or_left_to_the_platform():
    custom = pod_of(make_spec(securityContext={"runAsUser": 2000, "fsGroup": 3000}))["securityContext"]
    assert (custom["runAsUser"], custom["runAsGroup"], custom["fsGroup"]) == (2000, 0, 3000)
    platform = pod_of(make_spec(securityContext={"platformAssignedIds": True}))["securityContext"]
    assert not {"runAsUser", "runAsGroup", "fsGroup"} & platform.keys()
    # What OpenShift's restricted-v2 SCC still demands holds either way.
    assert platform["runAsNonRoot"] is True and platform["seccompProfile"] == {"type": "RuntimeDefault"}
    server = pod_of(make_spec(securityContext={"platformAssignedIds": True}))["containers"][0]
    assert server["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert server["securityContext"]["allowPrivilegeEscalation"] is False


def test_pvc_source_mounts_the_claim_read_only_at_its_sub_path():
    spec = make_spec({"pvc": {"claimName": "weights", "subPath": "llama/8b"}})
    pod, server = pod_of(spec), server_of(spec)
    volume = next(v for v in pod["volumes"] if v["name"] == "model")
    assert volume["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    mount = next(m for m in server["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True, "subPath": "llama/8b"}
    assert flag(server["command"], "--model") == "/models"
    assert "initContainers" not in pod


def test_host_path_source_mounts_the_directory():
    spec = make_spec({"hostPath": {"path": "/srv/models/tiny"}})
    pod, server = pod_of(spec), server_of(spec)
    volume = next(v for v in pod["volumes"] if v["name"] == "model")
    assert volume["hostPath"] == {"path": "/srv/models/tiny", "type": "Directory"}
    assert flag(server["command"], "--model") == "/models"
    assert "initContainers" not in pod


def job_of(spec: Eagle3TargetSpec, name: str = "tiny") -> dict[str, Any]:
    return children(spec, name)["Job"]


def test_hugging_face_source_is_downloaded_once_by_a_job_the_pods_wait_for():
    source = {
        "huggingFace": {
            "repo": "org/tiny-model",
            "revision": "refs/pr/3",
            "cacheClaimName": "hf-cache",
            "tokenSecretRef": {"name": "hf-token", "key": "HF_TOKEN"},
        }
    }
    spec = make_spec(source, replicas=3)
    job, pod, server = job_of(spec), pod_of(spec), server_of(spec)
    (download,) = job["spec"]["template"]["spec"]["containers"]
    command = download["command"]
    assert command[:4] == ["eagle3-target", "hydrate", "--repo", "org/tiny-model"]
    assert flag(command, "--revision") == "refs/pr/3"
    target_dir = flag(command, "--local-dir")
    assert target_dir == "/models/huggingface/org/tiny-model/refs--pr--3"
    assert flag(command, "--progress-port") == str(download["ports"][0]["containerPort"])
    assert flag(server["command"], "--model") == target_dir
    assert flag(server["command"], "--revision") == "refs/pr/3"
    token = next(e for e in download["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}
    assert "HF_TOKEN" not in {e["name"] for e in server["env"]}  # the server never needs the Hub token
    job_pod = job["spec"]["template"]["spec"]
    assert job_pod["volumes"] == [{"name": "model", "persistentVolumeClaim": {"claimName": "hf-cache"}}]
    assert {"name": "model", "mountPath": "/models"} in download["volumeMounts"]  # writable for the download
    assert (
        job_pod["restartPolicy"] == "Never"
        and download["terminationMessagePolicy"] == "FallbackToLogsOnError"
    )
    (rule,) = job["spec"]["podFailurePolicy"]["rules"]  # exit 2: a download that cannot succeed
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["values"] == [2]
    # The server pods only wait for the marker the Job writes last, reading the claim.
    (wait,) = pod["initContainers"]
    assert wait["command"] == ["eagle3-target", "wait-for-model", "--local-dir", target_dir]
    assert all(m.get("readOnly") for c in (wait, server) for m in c["volumeMounts"] if m["name"] == "model")
    assert download["securityContext"] == server["securityContext"] == wait["securityContext"]


def test_the_download_runs_where_the_targets_pods_may_and_pulls_like_them():
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    spec = make_spec(
        HF_SOURCE,
        nodeSelector={"pool": "gpu"},
        tolerations=[toleration],
        imagePullSecrets=[{"name": "registry"}],
        priorityClassName="high",
        runtimeClassName="nvidia",
    )
    job_pod = job_of(spec)["spec"]["template"]["spec"]
    assert job_pod["nodeSelector"] == {"pool": "gpu"} and job_pod["tolerations"] == [toleration]
    assert job_pod["imagePullSecrets"] == [{"name": "registry"}]
    # The server's GPU runtime and priority are the server's: the download needs neither.
    assert "runtimeClassName" not in job_pod and "priorityClassName" not in job_pod
    assert "nvidia.com/gpu" not in str(job_pod["containers"][0]["resources"])  # no GPU for a download


def test_no_server_pod_is_asked_for_until_the_cache_is_hydrated():
    spec = make_spec(HF_SOURCE, replicas=3)
    pending = render.build_children("tiny", "ml", UID, spec, pod_monitor_supported=False, hydrated=False)
    deployment = next(child for child in pending if child["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 0
    assert children(spec)["Deployment"]["spec"]["replicas"] == 3


def test_hydration_pods_are_selected_by_nothing_that_selects_server_pods():
    spec = make_spec(HF_SOURCE, replicas=3, networkPolicy={"enabled": True})
    rendered = children(spec)
    labels = rendered["Job"]["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "model-hydration"
    assert labels["app.kubernetes.io/instance"] == "tiny"  # the operator's pod index finds them by target
    for selector in (
        rendered["Service"]["spec"]["selector"],
        rendered["Deployment"]["spec"]["selector"]["matchLabels"],
        rendered["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
        rendered["NetworkPolicy"]["spec"]["podSelector"]["matchLabels"],
    ):
        assert not selector.items() <= labels.items()


def test_the_job_is_named_for_what_it_downloads():
    """A Job's pod template cannot change: a different download is a different Job; the same one keeps it."""
    names = {
        render.hydration_job_name("tiny", make_spec(source))
        for source in (
            HF_SOURCE,
            {"huggingFace": {**HF_SOURCE["huggingFace"], "revision": "v2"}},
            {"huggingFace": {**HF_SOURCE["huggingFace"], "cacheClaimName": "other-cache"}},
            {"huggingFace": {**HF_SOURCE["huggingFace"], "repo": "org/other"}},
        )
    }
    assert len(names) == 4
    assert render.hydration_job_name("tiny", make_spec(HF_SOURCE, replicas=5)) in names
    assert render.hydration_job_name("tiny", make_spec()) is None
    long_name = render.hydration_job_name(LONG_NAME, make_spec(HF_SOURCE))
    assert len(long_name) <= 63 and DNS_1035.match(long_name)


@pytest.mark.parametrize(
    ("hf_revision", "model_revision", "expected"),
    [("v2", "abc", "v2"), (None, "abc", "abc"), (None, None, "main")],
)
def test_hugging_face_revision_falls_back_to_the_models_then_main(hf_revision, model_revision, expected):
    hub = {"repo": "org/tiny-model", "cacheClaimName": "hf-cache"} | (
        {"revision": hf_revision} if hf_revision else {}
    )
    model = {"name": "m", "source": {"huggingFace": hub}} | (
        {"revision": model_revision} if model_revision else {}
    )
    spec = Eagle3TargetSpec.parse({"model": model})
    assert (
        flag(job_of(spec)["spec"]["template"]["spec"]["containers"][0]["command"], "--revision") == expected
    )
    assert flag(pod_of(spec)["containers"][0]["command"], "--revision") == expected


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
    assert server_of(make_spec())["image"] == render.DEFAULT_IMAGE


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
        assert pdb["selector"] == {"matchLabels": render.selector_labels("tiny")}
        assert pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_pod_monitor_when_enabled_and_its_crd_exists():
    monitoring = {"podMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}}}
    spec = make_spec(monitoring=monitoring)
    monitor = children(spec)["PodMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["selector"] == {"matchLabels": render.selector_labels("tiny")}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint == {"port": "metrics", "path": "/metrics", "interval": "15s"}
    assert endpoint["port"] in {p["name"] for p in server_of(spec)["ports"]}
    unsupported = render.build_children("tiny", "ml", UID, spec, pod_monitor_supported=False)
    assert "PodMonitor" not in {child["kind"] for child in unsupported}
    assert "PodMonitor" not in children(make_spec())


def test_operator_labels_win_over_pod_monitor_labels():
    monitoring = {"podMonitor": {"enabled": True, "labels": {"app.kubernetes.io/instance": "other"}}}
    monitor = children(make_spec(monitoring=monitoring))["PodMonitor"]
    assert monitor["metadata"]["labels"]["app.kubernetes.io/instance"] == "tiny"


def test_external_target_has_no_children():
    spec = Eagle3TargetSpec.parse({"endpoint": {"url": "https://target.example:8443/"}})
    assert render.build_children("ext", "ml", UID, spec, pod_monitor_supported=True) == []
    assert render.service_url("ext", "ml", spec) == "https://target.example:8443"


def test_children_do_not_share_mutable_parts():
    rendered = render.build_children("tiny", "ml", UID, make_spec(replicas=2), pod_monitor_supported=True)
    rendered[0]["metadata"]["ownerReferences"][0]["name"] = "changed"
    assert all(child["metadata"]["ownerReferences"][0]["name"] == "tiny" for child in rendered[1:])


LONG_NAME = "a-very-long-target-name-for-a-llama-3.1-405b-instruct-fp8-target-in-the-research-namespace"


@pytest.mark.parametrize("name", ["tiny", "x" * 63, "x" * 64, LONG_NAME, "8b-target", "llama-3.1-8b"])
def test_names_fit_the_63_character_limit(name):
    for child in children(
        make_spec(replicas=2, monitoring={"podMonitor": {"enabled": True}}), name=name
    ).values():
        assert DNS_1035.match(child["metadata"]["name"]), child["metadata"]["name"]
        assert len(child["metadata"]["name"]) <= 63
        for value in child["metadata"]["labels"].values():
            assert len(value) <= 63 and LABEL_VALUE.match(value)


def test_short_valid_names_are_kept_and_others_get_a_hash():
    assert render.child_name("tiny") == "tiny"
    assert render.child_name("x" * 63) == "x" * 63
    long = render.child_name(LONG_NAME)
    assert long.startswith("a-very-long-target-name") and len(long) <= 63
    dotted = render.child_name("llama-3.1-8b")  # '.' may not appear in a Service name
    assert dotted.startswith("llama-3-1-8b-") and dotted != render.child_name("llama-3-1-8b")
    assert render.child_name("8b").startswith("e3t-8b-")


def test_instance_label_is_the_target_name_whenever_it_can_be():
    assert render.selector_labels("llama-3.1-8b")["app.kubernetes.io/instance"] == "llama-3.1-8b"
    assert render.selector_labels("8b")["app.kubernetes.io/instance"] == "8b"
    too_long = render.selector_labels("x" * 64)["app.kubernetes.io/instance"]
    assert too_long == render.child_name("x" * 64) and len(too_long) <= 63
    assert render.selector_labels("x" * 64) != render.selector_labels("x" * 65)


@settings(deadline=None)  # no timing assertions: a loaded CI machine must not fail this
@given(st.from_regex(r"[a-z0-9]([-a-z0-9.]{0,120}[a-z0-9])?", fullmatch=True))
def test_any_resource_name_maps_to_a_valid_stable_service_name(name):
    service = render.child_name(name)
    assert DNS_1035.match(service) and len(service) <= 63
    assert service == render.child_name(name)


@settings(deadline=None)
@given(
    st.from_regex(r"[a-z][-a-z0-9]{60,80}[a-z0-9]", fullmatch=True),
    st.from_regex(r"[a-z][-a-z0-9]{60,80}[a-z0-9]", fullmatch=True),
)
def test_distinct_long_names_stay_distinct(first, second):
    if first != second:
        assert render.child_name(first) != render.child_name(second)


def test_rendered_children_pass_a_server_side_dry_run(cluster, namespace):
    """The API server's own validation accepts every rendered object (the PodMonitor needs its CRD, which this
    cluster does not have, so it is left out)."""
    spec = make_spec(
        HF_SOURCE,
        replicas=2,
        tensorParallelSize=2,
        auxLayerIds=[1, 2, 3],
        maxModelLen=2048,
        engineArgs={"gpu-memory-utilization": "0.9"},
        resources={"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        auth={"tokenSecretRef": {"name": "token"}},
        affinity={"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
        **POD_SETTINGS,
        networkPolicy={
            "enabled": True,
            "allowedNamespaces": ["trainers"],
            "namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In", "values": ["ml"]}]},
        },
    )
    client = kubernetes.dynamic.DynamicClient(cluster.api_client)
    neighbours = render.Neighbours(operator_namespace="eagle3-system", prometheus_namespace="monitoring")
    rendered = render.build_children(
        LONG_NAME, namespace, UID, spec, pod_monitor_supported=False, neighbours=neighbours
    )
    kinds = {child["kind"] for child in rendered}
    assert kinds == {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "Job"}
    for child in rendered:
        api = client.resources.get(api_version=child["apiVersion"], kind=child["kind"])
        created = api.create(body=child, namespace=namespace, dry_run="All")
        assert created.metadata.name == child["metadata"]["name"]


def test_metrics_have_a_port_of_their_own():
    server = server_of(make_spec(monitoring={"metricsPort": 9400}))
    assert server["ports"][1] == {"name": "metrics", "containerPort": 9400, "protocol": "TCP"}
    assert flag(server["command"], "--metrics-port") == "9400"
    assert flag(server_of(make_spec())["command"], "--metrics-port") == "9090"


NEIGHBOURS = render.Neighbours(operator_namespace="eagle3-system", prometheus_namespace="monitoring")


def policy_of(spec: Eagle3TargetSpec, neighbours: render.Neighbours = NEIGHBOURS) -> dict[str, Any] | None:
    rendered = render.build_children(
        "tiny", "ml", UID, spec, pod_monitor_supported=True, neighbours=neighbours
    )
    return next((child for child in rendered if child["kind"] == "NetworkPolicy"), None)


def namespace_names(peer: dict[str, Any]) -> list[str]:
    (expression,) = peer["namespaceSelector"]["matchExpressions"]
    assert (expression["key"], expression["operator"]) == ("kubernetes.io/metadata.name", "In")
    return expression["values"]


def test_network_policy_only_when_enabled():
    assert policy_of(make_spec()) is None
    assert policy_of(make_spec(networkPolicy={"enabled": False, "allowedNamespaces": ["a"]})) is None


def test_network_policy_admits_the_data_port_to_the_named_and_selected_namespaces_only():
    selector = {"matchLabels": {"team": "ml"}}
    spec = make_spec(
        networkPolicy={"enabled": True, "allowedNamespaces": ["trainers"], "namespaceSelector": selector}
    )
    policy = policy_of(spec)
    assert policy["metadata"]["name"] == "tiny"
    assert policy["metadata"]["ownerReferences"] == [render.owner_reference("tiny", UID)]
    assert policy["spec"]["podSelector"] == {"matchLabels": render.selector_labels("tiny")}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    data, metrics = policy["spec"]["ingress"]
    assert data["ports"] == [{"protocol": "TCP", "port": "http"}]
    named, selected = data["from"]
    assert namespace_names(named) == ["eagle3-system", "trainers"]
    assert selected == {"namespaceSelector": selector}
    assert metrics["ports"] == [{"protocol": "TCP", "port": "metrics"}]
    (scraper,) = metrics["from"]
    assert namespace_names(scraper) == ["monitoring"]


def test_network_policy_never_renders_a_rule_that_admits_everyone():
    """An ingress rule without peers would admit every source; with nobody to admit there is no rule."""
    policy = policy_of(make_spec(networkPolicy={"enabled": True}), render.Neighbours())
    assert policy["spec"]["ingress"] == []
    only_operator = policy_of(make_spec(networkPolicy={"enabled": True}), render.Neighbours("ops"))
    (data,) = only_operator["spec"]["ingress"]
    assert [namespace_names(peer) for peer in data["from"]] == [["ops"]]


def test_every_flag_the_operator_passes_has_its_env_twin_refused():
    """A spec.env entry naming a setting the command line already sets would be silently ignored."""
    model = {"name": "m", "dtype": "bfloat16", "trustRemoteCode": True, "source": HF_SOURCE}
    spec = Eagle3TargetSpec.parse(
        {
            "model": model,
            "auxLayerIds": [1, 2, 3],
            "maxModelLen": 64,
            "engineArgs": {"a": "b"},
            "auth": {"tokenSecretRef": {"name": "t"}},
        }
    )
    flags = [part for part in render.server_args(spec)[2:] if part.startswith("--")]
    twins = {f"EAGLE3_TARGET_{flag[2:].replace('-', '_').upper()}" for flag in flags}
    twins = {"EAGLE3_TARGET_ENGINE_ARGS" if twin == "EAGLE3_TARGET_ENGINE_ARG" else twin for twin in twins}
    assert twins <= OPERATOR_ENV
