"""The CRD against the real API server: good targets are accepted with the typed spec's defaults, bad ones are
rejected with the CRD's readable messages (and the typed spec rejects them too), and the status and scale
subresources, printer columns and names work the way kubectl users expect."""

import copy
import json
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from eagle3_operator.render.names import label_selector
from eagle3_operator.spec import Eagle3TargetSpec, InvalidSpec
from eagle3_target.protocol import API_VERSION, KIND, MAX_CAPTURE_LAYERS, PLURAL, TargetInfo

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = [ROOT / "examples" / name for name in ("quickstart.yaml", "llama-3.1-8b/target.yaml")]

PVC = {"pvc": {"claimName": "models"}}
HF = {"huggingFace": {"repo": "org/tiny", "cacheClaimName": "hf-cache", "tokenSecretRef": {"name": "hf"}}}


# A server's /v1/info answer (as the probe reads it), without its capture set.
INFO = {
    "model": "org/tiny",
    "revision": "r1",
    "engine": "hf",
    "dtype": "float32",
    "num_hidden_layers": 8,
    "hidden_size": 64,
    "vocab_size": 256,
    "aux_layer_ids": [0, 2, 4],
    "fingerprint": "sha256:aaaa",
    "formats": ["hidden"],
    "max_batch_tokens": 4096,
    "max_model_len": 512,
    "version": "0",
}


def target(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name}, "spec": spec}


def with_model(source: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    model: dict[str, Any] = {"name": "org/tiny"}
    if source is not None:
        model["source"] = source
    return {"model": model, **fields}


@pytest.fixture(scope="module")
def target_api(cluster, crd) -> kubernetes.dynamic.Resource:
    """Eagle3Targets through the dynamic client, once the CRD is Established."""
    client = kubernetes.dynamic.DynamicClient(cluster.api_client)
    return client.resources.get(api_version=API_VERSION, kind=KIND)


def rejection(target_api: kubernetes.dynamic.Resource, namespace: str, body: dict[str, Any]) -> str:
    """The API server's message for a create it refuses (dry run, so nothing is stored)."""
    with pytest.raises(kubernetes.dynamic.exceptions.DynamicApiError) as caught:
        target_api.create(body=body, namespace=namespace, dry_run="All")
    assert caught.value.status == 422, caught.value.body
    return json.loads(caught.value.body)["message"]


GOOD_SPECS = {
    "pvc with sub path": with_model({"pvc": {"claimName": "models", "subPath": "llama/8b"}}),
    "host path": with_model({"hostPath": {"path": "/srv/models/tiny"}}, engine="hf", tensorParallelSize=0),
    "hugging face": with_model(HF, replicas=2),
    "hugging face through a mirror and a proxy": with_model(
        {
            "huggingFace": {
                **HF["huggingFace"],
                "env": [
                    {"name": "HF_ENDPOINT", "value": "https://hub-mirror.example"},
                    {"name": "HTTPS_PROXY", "valueFrom": {"secretKeyRef": {"name": "proxy", "key": "url"}}},
                    {"name": "NO_PROXY", "value": ".svc,.cluster.local"},
                ],
                "resources": {"requests": {"cpu": 2, "memory": "2Gi"}, "limits": {"memory": "16Gi"}},
            }
        }
    ),
    "external": {"endpoint": {"url": "https://target.example:8443/base"}},
    "everything": with_model(
        PVC,
        engine="vllm",
        auxLayerIds=[1, 15, 28],
        tensorParallelSize=8,
        replicas=3,
        suspend=True,
        maxModelLen=8192,
        engineArgs={"gpu-memory-utilization": "0.9", "max_num_seqs": "64"},
        image="registry.example/eagle3-target:dev",
        resources={"requests": {"cpu": 8, "memory": "64Gi"}, "limits": {"memory": "96Gi"}},
        nodeSelector={"nvidia.com/gpu.product": "H100"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        affinity={"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
        priorityClassName="high",
        imagePullSecrets=[{"name": "registry"}],
        startupTimeoutSeconds=3600,
        port=9000,
        auth={"tokenSecretRef": {"name": "token", "key": "bearer"}},
        monitoring={"podMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}}},
        env=[
            {"name": "NCCL_DEBUG", "value": "INFO"},
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hub", "key": "token"}}},
        ],
        volumes=[{"name": "nvme", "hostPath": {"path": "/mnt/nvme"}}],
        volumeMounts=[{"name": "nvme", "mountPath": "/cache", "subPath": "vllm"}],
        podMetadata={"labels": {"kueue.x-k8s.io/queue-name": "gpus"}, "annotations": {"a.example/b": "c"}},
        runtimeClassName="nvidia",
        serviceAccountName="bucket-reader",
        schedulerName="volcano",
        topologySpreadConstraints=[
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "DoNotSchedule",
                "labelSelector": {"matchExpressions": [{"key": "a", "operator": "In", "values": ["b"]}]},
            }
        ],
        shmSize="64Gi",
        securityContext={"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000},
        rollout={"maxSurge": "25%", "maxUnavailable": 0},
        idle={"scaleToZeroAfter": "1h30m"},
    ),
    "capture set around the aux layers": with_model(
        PVC, auxLayerIds=[1, 15, 28], captureLayerIds=[28, 0, 1, 15, 31]
    ),
    "largest capture set": with_model(PVC, captureLayerIds=list(range(MAX_CAPTURE_LAYERS))),
    "platform ids and integer shm": with_model(
        PVC, securityContext={"platformAssignedIds": True}, shmSize=2**34
    ),
}


@pytest.mark.parametrize("case", sorted(GOOD_SPECS))
def test_good_targets_are_accepted_with_the_typed_specs_defaults(target_api, namespace, case):
    spec = GOOD_SPECS[case]
    stored = target_api.create(body=target("good", spec), namespace=namespace, dry_run="All").to_dict()
    # Defaults filled in by the API server are exactly the ones the typed spec assumes.
    assert Eagle3TargetSpec.parse(stored["spec"]) == Eagle3TargetSpec.parse(spec)
    if "endpoint" not in spec:
        assert stored["spec"]["startupTimeoutSeconds"] == spec.get("startupTimeoutSeconds", 1800)
        assert stored["spec"]["port"] == spec.get("port", 8000)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_pass_a_server_side_dry_run(cluster, target_api, namespace, path):
    documents = list(yaml.safe_load_all(path.read_text()))
    for document in documents:
        document["metadata"].pop("namespace", None)  # into the test's namespace
    manifest = yaml.safe_dump_all(documents)
    result = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=manifest)
    assert "eagle3target.eagle3.dev/" in result.stdout


BAD_SPECS = {
    "no model": ({}, "spec.model.source is required"),
    "no source": (with_model(), "spec.model.source is required"),
    "empty source": (with_model({}), "exactly one of pvc, hostPath, huggingFace must be set"),
    "two sources": (
        with_model({**PVC, "hostPath": {"path": "/m"}}),
        "exactly one of pvc, hostPath, huggingFace must be set",
    ),
    "source and endpoint": (with_model(PVC, endpoint={"url": "http://x:1"}), "are mutually exclusive"),
    "unknown engine": (with_model(PVC, engine="trt"), 'supported values: "vllm", "sglang", "hf"'),
    "two aux layers": (with_model(PVC, auxLayerIds=[1, 2]), "spec.auxLayerIds: Invalid value"),
    "repeated aux layer": (with_model(PVC, auxLayerIds=[1, 1, 2]), "auxLayerIds must be 3 distinct"),
    "empty capture set": (with_model(PVC, captureLayerIds=[]), "spec.captureLayerIds: Invalid value"),
    "capture set too large": (
        with_model(PVC, captureLayerIds=list(range(MAX_CAPTURE_LAYERS + 1))),
        f"spec.captureLayerIds: Too many: {MAX_CAPTURE_LAYERS + 1}: must have at most {MAX_CAPTURE_LAYERS}",
    ),
    "repeated capture layer": (
        with_model(PVC, captureLayerIds=[3, 5, 3]),
        "captureLayerIds must be distinct decoder-layer ids",
    ),
    "negative capture layer": (with_model(PVC, captureLayerIds=[0, -1]), "spec.captureLayerIds[1]"),
    "aux layers not captured": (
        with_model(PVC, auxLayerIds=[1, 15, 28], captureLayerIds=[1, 15, 27]),
        "every auxLayerIds id must be in captureLayerIds",
    ),
    "vllm without gpus": (with_model(PVC, tensorParallelSize=0), "engines vllm and sglang need GPUs"),
    "sglang without gpus": (
        with_model(PVC, engine="sglang", tensorParallelSize=0),
        "engines vllm and sglang need GPUs",
    ),
    "privileged port": (with_model(PVC, port=80), "spec.port: Invalid value: 80"),
    "tiny startup budget": (with_model(PVC, startupTimeoutSeconds=1), "spec.startupTimeoutSeconds"),
    "negative replicas": (with_model(PVC, replicas=-1), "spec.replicas"),
    "reserved engine arg": (with_model(PVC, engineArgs={"max_model_len": "1"}), "use the spec's own fields"),
    "odd engine arg key": (with_model(PVC, engineArgs={"a b": "1"}), "keys must be flag names"),
    "gpu in resources": (
        with_model(PVC, resources={"limits": {"nvidia.com/gpu": 1}}),
        "it comes from tensorParallelSize",
    ),
    "bad quantity": (
        with_model(PVC, resources={"requests": {"memory": "lots"}}),
        "spec.resources.requests.memory",
    ),
    "relative host path": (with_model({"hostPath": {"path": "models"}}), "must be an absolute path"),
    "escaping sub path": (
        with_model({"pvc": {"claimName": "m", "subPath": "a/../../etc"}}),
        "subPath must be a relative path without '..'",
    ),
    "bad hf repo": (
        with_model({"huggingFace": {"repo": "not a repo", "cacheClaimName": "c"}}),
        "huggingFace.repo must look like owner/name",
    ),
    "hf without cache": (with_model({"huggingFace": {"repo": "org/tiny"}}), "cacheClaimName: Required value"),
    "model revision that climbs out of the cache": (
        {
            "model": {
                "name": "m",
                "revision": "..",
                "source": {"huggingFace": {"repo": "org/tiny", "cacheClaimName": "c"}},
            }
        },
        "spec.model.revision must be a branch, tag or commit name",
    ),
    "ftp endpoint": (
        {"endpoint": {"url": "ftp://files.example/model"}},
        "must be an absolute http or https URL",
    ),
    "bad toleration": (
        with_model(PVC, tolerations=[{"key": "k", "operator": "Maybe"}]),
        "spec.tolerations[0].operator: Unsupported value",
    ),
    "operator env": (
        with_model(PVC, env=[{"name": "EAGLE3_TARGET_PORT", "value": "1"}]),
        "env must not set HF_HUB_OFFLINE or the EAGLE3_TARGET_* settings",
    ),
    "hub switch env": (
        with_model(PVC, env=[{"name": "HF_HUB_OFFLINE", "value": "0"}]),
        "env must not set HF_HUB_OFFLINE",
    ),
    "env value and value from": (
        with_model(PVC, env=[{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]),
        "sets value or valueFrom, not both",
    ),
    "bad env name": (with_model(PVC, env=[{"name": "1 A", "value": "1"}]), "env names are letters"),
    "repeated env name": (
        with_model(PVC, env=[{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]),
        'spec.env[1]: Duplicate value: {"name":"A"}',
    ),
    "operator volume": (
        with_model(PVC, volumes=[{"name": "dshm", "emptyDir": {}}]),
        "volumes must not be named model, dshm, auth or scratch",
    ),
    "repeated volume": (
        with_model(PVC, volumes=[{"name": "a", "emptyDir": {}}, {"name": "a", "emptyDir": {}}]),
        "spec.volumes[1]: Duplicate value",
    ),
    "mount over the model": (
        with_model(
            PVC, volumes=[{"name": "a", "emptyDir": {}}], volumeMounts=[{"name": "a", "mountPath": "/models"}]
        ),
        "volumeMounts must not be at, under or above /models",
    ),
    "mount above the auth token": (
        with_model(
            PVC,
            volumes=[{"name": "a", "emptyDir": {}}],
            volumeMounts=[{"name": "a", "mountPath": "/var/run"}],
        ),
        "volumeMounts must not be at, under or above",
    ),
    "idle window too short": (
        with_model(PVC, idle={"scaleToZeroAfter": "4s"}),
        "idle.scaleToZeroAfter must be at least 5s",
    ),
    "idle window not a duration": (with_model(PVC, idle={"scaleToZeroAfter": "2 hours"}), "scaleToZeroAfter"),
    "idle external target": (
        {"endpoint": {"url": "http://10.0.0.5:8000"}, "idle": {"scaleToZeroAfter": "1h"}},
        "an endpoint.url target has none",
    ),
    "mount of a missing volume": (
        with_model(PVC, volumeMounts=[{"name": "nowhere", "mountPath": "/cache"}]),
        "volumeMounts must name a volume of spec.volumes",
    ),
    "selector label": (
        with_model(PVC, podMetadata={"labels": {"app.kubernetes.io/instance": "other"}}),
        "podMetadata.labels must not set app.kubernetes.io/name, instance",
    ),
    "bad label value": (
        with_model(PVC, podMetadata={"labels": {"team": "a b"}}),
        "spec.podMetadata.labels.team: Invalid value",
    ),
    "bad label key": (
        with_model(PVC, podMetadata={"labels": {"a b": "c"}}),
        "podMetadata keys must be qualified names",
    ),
    "default container annotation": (
        with_model(PVC, podMetadata={"annotations": {"kubectl.kubernetes.io/default-container": "x"}}),
        "must not set kubectl.kubernetes.io/default-container",
    ),
    "bad runtime class": (with_model(PVC, runtimeClassName="Nvidia_GPU"), "runtimeClassName must be a DNS"),
    "bad service account": (with_model(PVC, serviceAccountName="a/b"), "serviceAccountName must be a DNS"),
    "spread without key": (
        with_model(PVC, topologySpreadConstraints=[{"maxSkew": 1, "whenUnsatisfiable": "DoNotSchedule"}]),
        "spec.topologySpreadConstraints[0].topologyKey: Required value",
    ),
    "spread with zero skew": (
        with_model(
            PVC,
            topologySpreadConstraints=[
                {"maxSkew": 0, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}
            ],
        ),
        "spec.topologySpreadConstraints[0].maxSkew: Invalid value: 0",
    ),
    "bad shm size": (with_model(PVC, shmSize="lots"), "shmSize must be a positive quantity"),
    "zero shm size": (with_model(PVC, shmSize="0"), "shmSize must be a positive quantity"),
    "fixed ids and platform ids": (
        with_model(PVC, securityContext={"platformAssignedIds": True, "runAsUser": 1000}),
        "platformAssignedIds leaves the ids to the platform",
    ),
    "root user": (with_model(PVC, securityContext={"runAsUser": 0}), "spec.securityContext.runAsUser"),
    "rollout that cannot start": (
        with_model(PVC, rollout={"maxSurge": "0%", "maxUnavailable": 0}),
        "rollout.maxSurge and rollout.maxUnavailable must not both be 0",
    ),
    "rollout with a fraction": (with_model(PVC, rollout={"maxSurge": "half"}), "spec.rollout.maxSurge"),
    "hub token in the download's env": (
        with_model({"huggingFace": {**HF["huggingFace"], "env": [{"name": "HF_TOKEN", "value": "hf_x"}]}}),
        "huggingFace.env must not set HF_TOKEN (use huggingFace.tokenSecretRef)",
    ),
    "operator setting in the download's env": (
        with_model(
            {"huggingFace": {**HF["huggingFace"], "env": [{"name": "EAGLE3_TARGET_X", "value": "1"}]}}
        ),
        "HF_HOME, HF_HUB_OFFLINE, HOME, TMPDIR or EAGLE3_TARGET_*: the operator sets them",
    ),
    "home off the scratch volume in the download's env": (
        with_model({"huggingFace": {**HF["huggingFace"], "env": [{"name": "HOME", "value": "/root"}]}}),
        "HF_HOME, HF_HUB_OFFLINE, HOME, TMPDIR or EAGLE3_TARGET_*: the operator sets them",
    ),
    "temporary directory off the scratch volume in the download's env": (
        with_model({"huggingFace": {**HF["huggingFace"], "env": [{"name": "TMPDIR", "value": "/tmp"}]}}),
        "HF_HOME, HF_HUB_OFFLINE, HOME, TMPDIR or EAGLE3_TARGET_*: the operator sets them",
    ),
    "gpu for the download": (
        with_model({"huggingFace": {**HF["huggingFace"], "resources": {"limits": {"nvidia.com/gpu": 1}}}}),
        "the download needs no GPU",
    ),
    "operator label on the pod monitor": (
        with_model(PVC, monitoring={"podMonitor": {"labels": {"app.kubernetes.io/instance": "x"}}}),
        "podMonitor.labels must not set app.kubernetes.io/name, instance, component or managed-by",
    ),
    "bad pod monitor label key": (
        with_model(PVC, monitoring={"podMonitor": {"labels": {"-release": "x"}}}),
        "podMonitor.labels keys must be qualified names",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_bad_targets_are_rejected_readably(target_api, namespace, case):
    spec, expected = BAD_SPECS[case]
    assert expected in rejection(target_api, namespace, target("bad", spec))
    with pytest.raises(InvalidSpec):  # the operator's own check agrees with the API server
        Eagle3TargetSpec.parse(spec)


def test_unknown_fields_are_refused_by_kubectl(cluster, target_api, namespace):
    body = yaml.safe_dump(target("typo", with_model(PVC, gpus=2)))
    result = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=body, check=False)
    assert result.returncode != 0
    assert 'unknown field "spec.gpus"' in result.stderr


def test_model_name_is_immutable(target_api, namespace):
    created = target_api.create(body=target("frozen", with_model(PVC)), namespace=namespace).to_dict()
    changed = copy.deepcopy(created)
    changed["spec"]["model"]["name"] = "org/other"
    with pytest.raises(kubernetes.dynamic.exceptions.DynamicApiError) as caught:
        target_api.replace(body=changed, namespace=namespace)
    assert "spec.model.name is immutable" in json.loads(caught.value.body)["message"]
    changed["spec"]["model"]["name"] = "org/tiny"
    changed["spec"]["replicas"] = 2  # everything else may change
    assert target_api.replace(body=changed, namespace=namespace).spec.replicas == 2


def publish_status(target_api, namespace: str, name: str, ready: str) -> None:
    """Write a status as the operator would, through the status subresource."""
    current = target_api.get(name=name, namespace=namespace)
    generation = current.metadata.generation
    status = {
        "observedGeneration": generation,
        "phase": "Ready" if ready == "True" else "Loading",
        "conditions": [
            {
                "type": "Ready",
                "status": ready,
                "reason": "Serving" if ready == "True" else "ModelLoading",
                "message": "",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
                "observedGeneration": generation,
            },
            {
                "type": "Available",
                "status": ready,
                "reason": "Serving" if ready == "True" else "ModelLoading",
                "message": "",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
                "observedGeneration": generation,
            },
        ],
        "url": f"http://{name}.{namespace}.svc:8000",
        "replicas": 2,
        "readyReplicas": 2 if ready == "True" else 0,
        "readyDesired": "2/2" if ready == "True" else "0/2",
        "selector": label_selector(name),
        "consumers": {"active": 2, "windowSeconds": 600, "clients": ["job-a/1-aa", "job-b/2-bb"]},
    }
    target_api.status.patch(
        body={"status": status}, name=name, namespace=namespace, content_type="application/merge-patch+json"
    )


def test_status_scale_printer_columns_and_wait(cluster, target_api, namespace):
    target_api.create(body=target("served", with_model(PVC, replicas=2)), namespace=namespace)
    publish_status(target_api, namespace, "served", "False")

    table = cluster.kubectl("get", "e3t", "served", "-n", namespace).stdout.splitlines()
    header = [
        "NAME",
        "READY",
        "REASON",
        "AVAILABLE",
        "READY/DESIRED",
        "ENGINE",
        "MODEL",
        "CONSUMERS",
        "URL",
        "AGE",
    ]
    assert table[0].split() == header
    assert table[1].split()[:9] == [
        "served",
        "False",
        "ModelLoading",
        "False",
        "0/2",
        "vllm",
        "org/tiny",
        "2",
        f"http://served.{namespace}.svc:8000",
    ]
    wide = cluster.kubectl("get", "e3t", "served", "-n", namespace, "-o", "wide").stdout
    assert "PHASE" in wide and "Loading" in wide

    publish_status(target_api, namespace, "served", "True")
    cluster.kubectl("wait", "--for=condition=Ready", "--timeout=10s", "-n", namespace, "e3t/served")

    cluster.kubectl("scale", "e3t/served", "--replicas=3", "-n", namespace)
    assert target_api.get(name="served", namespace=namespace).spec.replicas == 3
    scale = json.loads(cluster.kubectl("get", "--raw", scale_path(namespace, "served")).stdout)
    assert scale["status"]["selector"] == label_selector("served")
    assert scale["status"]["replicas"] == 2


def scale_path(namespace: str, name: str) -> str:
    return f"/apis/{API_VERSION}/namespaces/{namespace}/{PLURAL}/{name}/scale"


def test_the_status_keeps_the_served_capture_set(target_api, namespace):
    """status.model as the operator writes it from /v1/info, capture set included (nothing pruned)."""
    target_api.create(body=target("capturing", with_model(PVC)), namespace=namespace)
    model = (
        TargetInfo.model_validate(INFO | {"capture_layer_ids": [5, 0, 2, 4, 7]}).served_model().to_status()
    )
    target_api.status.patch(
        body={"status": {"model": model}},
        name="capturing",
        namespace=namespace,
        content_type="application/merge-patch+json",
    )
    stored = target_api.get(name="capturing", namespace=namespace).to_dict()["status"]["model"]
    assert stored == model and stored["captureLayerIds"] == [5, 0, 2, 4, 7]


def test_status_is_written_only_through_its_subresource(target_api, namespace):
    created = target_api.create(body=target("plain", with_model(PVC)), namespace=namespace).to_dict()
    created["status"] = {"phase": "Ready"}
    replaced = target_api.replace(body=created, namespace=namespace)
    assert not (replaced.to_dict().get("status") or {})


def test_short_name_and_category_list_targets(cluster, target_api, namespace):
    target_api.create(body=target("listed", with_model(PVC)), namespace=namespace)
    for kind in ("e3t", "eagle3", "eagle3targets.eagle3.dev"):
        names = cluster.kubectl("get", kind, "-n", namespace, "-o", "name").stdout.split()
        assert "eagle3target.eagle3.dev/listed" in names
