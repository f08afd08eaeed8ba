"""The typed spec mirrors the CRD field for field and default for default, and rejects bad specs readably."""

import re
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from eagle3_operator.constants import (
    OPERATOR_ENV,
    OPERATOR_LABEL_KEYS,
    OPERATOR_MOUNT_PATHS,
    OPERATOR_VOLUMES,
)
from eagle3_operator.spec import Eagle3TargetSpec, InvalidSpec, unknown_fields
from eagle3_target.protocol import MAX_CAPTURE_LAYERS
from pydantic import BaseModel

from support.crd import crd_manifest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = [ROOT / "examples" / name for name in ("quickstart.yaml", "llama-3.1-8b/target.yaml")]


def crd_spec_schema() -> dict[str, Any]:
    crd = crd_manifest()
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


def pvc_spec(**extra: Any) -> dict[str, Any]:
    return {"model": {"name": "tiny", "source": {"pvc": {"claimName": "models"}}}, **extra}


def nested_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside `X`, `X | None` or `list[X]`, if any (X may be Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) is typing.Annotated:
        return nested_model(typing.get_args(annotation)[0])
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) in (list, typing.Union):
        for argument in typing.get_args(annotation):
            found = nested_model(argument)
            if found is not None:
                return found
    return None


def compare_bounds(prop: dict[str, Any], metadata: list[Any], path: str) -> list[str]:
    """The difference between an integer schema's minimum/maximum and a field's ge/le, if any."""
    model_bounds = {k: getattr(m, k) for m in metadata for k in ("ge", "le") if hasattr(m, k)}
    crd_bounds = {k: prop[key] for k, key in (("ge", "minimum"), ("le", "maximum")) if key in prop}
    return [] if model_bounds == crd_bounds else [f"{path}: CRD bounds {crd_bounds} != model {model_bounds}"]


def item_metadata(annotation: Any) -> list[Any]:
    """The constraints on the items of `list[Annotated[int, Field(...)]]` (optional or not)."""
    for argument in typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,):
        if typing.get_origin(argument) is list:
            (item,) = typing.get_args(argument)
            return [m for info in getattr(item, "__metadata__", ()) for m in info.metadata]
    return []


def compare(schema: dict[str, Any], model: type[BaseModel], path: str) -> list[str]:
    """Every difference between a CRD object schema and a pydantic model: field names, defaults, integer
    bounds, nesting."""
    fields = {field.alias: field for field in model.model_fields.values()}
    problems = []
    if set(schema["properties"]) != set(fields):
        problems.append(f"{path}: CRD {sorted(schema['properties'])} != model {sorted(fields)}")
    for name in set(schema["properties"]) & set(fields):
        prop, field = schema["properties"][name], fields[name]
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):  # an object the CRD defaults to {} (its fields' own defaults)
            default = default.model_dump(by_alias=True, exclude_defaults=True)
        if "default" in prop and default != prop["default"]:
            problems.append(f"{path}.{name}: CRD default {prop['default']!r} != model {default!r}")
        if prop.get("type") == "integer":
            problems += compare_bounds(prop, field.metadata, f"{path}.{name}")
        if prop.get("items", {}).get("type") == "integer":
            problems += compare_bounds(prop["items"], item_metadata(field.annotation), f"{path}.{name}[]")
        sub_schema = prop.get("items", prop)
        if "properties" in sub_schema:
            sub_model = nested_model(field.annotation)
            if sub_model is None:
                problems.append(f"{path}.{name}: the CRD has an object here, the model does not")
            else:
                problems += compare(sub_schema, sub_model, f"{path}.{name}")
        if name in schema.get("required", []) and not field.is_required():
            problems.append(f"{path}.{name}: required in the CRD, optional in the model")
    return problems


def test_model_mirrors_the_crd_schema():
    assert compare(crd_spec_schema(), Eagle3TargetSpec, "spec") == []


def test_defaults_fill_in_like_the_crd():
    spec = Eagle3TargetSpec.parse(pvc_spec())
    assert (spec.engine, spec.replicas, spec.tensor_parallel_size, spec.port) == ("vllm", 1, 1, 8000)
    assert spec.startup_timeout_seconds == 1800
    assert spec.suspend is False and spec.external is False
    assert spec.monitoring.pod_monitor.enabled is False
    assert spec.model.trust_remote_code is False


def test_accepts_snake_case_names_too():
    spec = Eagle3TargetSpec.parse(
        {**pvc_spec(), "tensor_parallel_size": 4, "engineArgs": {"enforce-eager": "true"}}
    )
    assert spec.tensor_parallel_size == 4
    assert spec.engine_args == {"enforce-eager": "true"}


@pytest.mark.parametrize(
    "source",
    [
        {"pvc": {"claimName": "models", "subPath": "llama/8b"}},
        {"hostPath": {"path": "/srv/models/tiny"}},
        {"huggingFace": {"repo": "org/tiny", "cacheClaimName": "hf-cache", "tokenSecretRef": {"name": "hf"}}},
    ],
)
def test_each_model_source_parses(source):
    spec = Eagle3TargetSpec.parse({"model": {"name": "tiny", "source": source}})
    chosen = [name for name, value in spec.model.source if value is not None]
    assert len(chosen) == 1


def test_external_endpoint_needs_no_model():
    spec = Eagle3TargetSpec.parse({"endpoint": {"url": "http://10.0.0.5:8000"}})
    assert spec.external
    assert spec.model is None


def test_suspend_means_zero_pods():
    assert Eagle3TargetSpec.parse(pvc_spec(replicas=3, suspend=True)).effective_replicas == 0
    assert Eagle3TargetSpec.parse(pvc_spec(replicas=3)).effective_replicas == 3


@pytest.mark.parametrize(("given", "seconds"), [(None, None), ("5s", 5), ("2h", 7200), ("1h30m", 5400)])
def test_the_idle_window_is_a_duration(given, seconds):
    idle = {"scaleToZeroAfter": given} if given else {}
    assert Eagle3TargetSpec.parse(pvc_spec(idle=idle)).idle.after_seconds == seconds


@pytest.mark.parametrize(
    ("layers", "capture"),
    [
        ({}, None),
        (
            {"captureLayerIds": [9, 0, 4]},
            [9, 0, 4],
        ),  # the default aux layers must be in it: the server checks
        ({"auxLayerIds": [1, 3, 5], "captureLayerIds": [5, 0, 3, 1, 7]}, [5, 0, 3, 1, 7]),
        ({"captureLayerIds": list(range(MAX_CAPTURE_LAYERS))}, list(range(MAX_CAPTURE_LAYERS))),
    ],
)
def test_a_capture_set_keeps_its_order(layers, capture):
    assert Eagle3TargetSpec.parse(pvc_spec(**layers)).capture_layer_ids == capture


def test_the_crd_bounds_a_capture_set_as_the_protocol_does():
    """One home for the largest capture set: the CRD's maxItems is the protocol's MAX_CAPTURE_LAYERS."""
    schema = crd_spec_schema()["properties"]["captureLayerIds"]
    assert (schema["minItems"], schema["maxItems"]) == (1, MAX_CAPTURE_LAYERS)
    assert schema["items"] == crd_spec_schema()["properties"]["auxLayerIds"]["items"]


def test_hf_engine_may_run_without_gpus():
    assert Eagle3TargetSpec.parse(pvc_spec(engine="hf", tensorParallelSize=0)).tensor_parallel_size == 0


BAD_SPECS = {
    "no source": (
        {"model": {"name": "tiny"}},
        "spec: model.source (pvc, hostPath or huggingFace) is required",
    ),
    "two sources": (
        {"model": {"name": "t", "source": {"pvc": {"claimName": "m"}, "hostPath": {"path": "/m"}}}},
        "spec.model.source: exactly one of pvc, hostPath, huggingFace",
    ),
    "empty source": ({"model": {"name": "t", "source": {}}}, "spec.model.source: exactly one of"),
    "source and endpoint": (pvc_spec(endpoint={"url": "http://x:1"}), "mutually exclusive"),
    "unknown engine": (pvc_spec(engine="trt"), "spec.engine: Input should be 'vllm', 'sglang' or 'hf'"),
    "two aux layers": (pvc_spec(auxLayerIds=[1, 2]), "spec.auxLayerIds: must be exactly 3 distinct"),
    "repeated aux layer": (pvc_spec(auxLayerIds=[1, 1, 2]), "spec.auxLayerIds: must be exactly 3 distinct"),
    "negative aux layer": (pvc_spec(auxLayerIds=[-1, 1, 2]), "spec.auxLayerIds.0"),
    "empty capture set": (pvc_spec(captureLayerIds=[]), "spec.captureLayerIds: List should have at least 1"),
    "capture set too large": (
        pvc_spec(captureLayerIds=list(range(MAX_CAPTURE_LAYERS + 1))),
        f"spec.captureLayerIds: List should have at most {MAX_CAPTURE_LAYERS} items",
    ),
    "repeated capture layer": (
        pvc_spec(captureLayerIds=[1, 5, 1]),
        "spec.captureLayerIds: must be distinct decoder-layer ids",
    ),
    "negative capture layer": (pvc_spec(captureLayerIds=[0, -1]), "spec.captureLayerIds.1"),
    "capture layer beyond the bound": (pvc_spec(captureLayerIds=[1025]), "spec.captureLayerIds.0"),
    "aux layers not captured": (
        pvc_spec(auxLayerIds=[1, 3, 5], captureLayerIds=[1, 3, 7]),
        "every auxLayerIds id must be in captureLayerIds (the EAGLE-3 aux layers are part of the capture "
        "set); it lacks [5]",
    ),
    "vllm without gpus": (pvc_spec(tensorParallelSize=0), "engine vllm needs GPUs"),
    "sglang without gpus": (pvc_spec(engine="sglang", tensorParallelSize=0), "engine sglang needs GPUs"),
    "privileged port": (pvc_spec(port=80), "spec.port: Input should be greater than or equal to 1024"),
    "short startup budget": (pvc_spec(startupTimeoutSeconds=5), "spec.startupTimeoutSeconds"),
    "reserved engine arg": (pvc_spec(engineArgs={"max_model_len": "4096"}), "use that field instead"),
    "odd engine arg": (pvc_spec(engineArgs={"--x y": "1"}), "must be a flag name"),
    "gpu in resources": (
        pvc_spec(resources={"limits": {"nvidia.com/gpu": 2}}),
        "spec.resources: resources must not ask for nvidia.com/gpu; it comes from tensorParallelSize",
    ),
    "gpu for the download": (
        {
            "model": {
                "name": "t",
                "source": {
                    "huggingFace": {
                        "repo": "org/tiny",
                        "cacheClaimName": "c",
                        "resources": {"requests": {"nvidia.com/gpu": 1}},
                    }
                },
            }
        },
        "huggingFace.resources must not ask for nvidia.com/gpu; the download needs no GPU",
    ),
    "bad quantity": (
        pvc_spec(resources={"requests": {"memory": "lots"}}),
        "'lots' is not a Kubernetes quantity",
    ),
    "relative host path": ({"model": {"name": "t", "source": {"hostPath": {"path": "m"}}}}, "hostPath.path"),
    "escaping sub path": (
        {"model": {"name": "t", "source": {"pvc": {"claimName": "m", "subPath": "a/../../etc"}}}},
        "spec.model.source.pvc.subPath: must not contain '..'",
    ),
    "bad hf repo": (
        {"model": {"name": "t", "source": {"huggingFace": {"repo": "a b", "cacheClaimName": "c"}}}},
        "spec.model.source.huggingFace.repo",
    ),
    "bad url": ({"endpoint": {"url": "ftp://x"}}, "spec.endpoint.url"),
    "idle window not a duration": (
        pvc_spec(idle={"scaleToZeroAfter": "2 hours"}),
        "spec.idle.scaleToZeroAfter",
    ),
    "idle window too short": (pvc_spec(idle={"scaleToZeroAfter": "4s"}), "must be at least 5s"),
    "idle external target": (
        {"endpoint": {"url": "http://x:1"}, "idle": {"scaleToZeroAfter": "1h"}},
        "an endpoint.url target has none",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_bad_specs_are_rejected_readably(case):
    raw, expected = BAD_SPECS[case]
    with pytest.raises(InvalidSpec) as caught:
        Eagle3TargetSpec.parse(raw)
    assert expected in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_every_problem_is_reported_at_once():
    with pytest.raises(InvalidSpec) as caught:
        Eagle3TargetSpec.parse(pvc_spec(port=1, replicas=-1))
    assert "spec.port" in str(caught.value) and "spec.replicas" in str(caught.value)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_parse(path):
    targets = [doc for doc in yaml.safe_load_all(path.read_text()) if doc and doc["kind"] == "Eagle3Target"]
    assert targets
    for target in targets:
        Eagle3TargetSpec.parse(target["spec"])


def test_the_gpu_example_leaves_the_gpu_runtime_and_node_labels_to_the_cluster():
    """No runtime class or GPU node label that some clusters lack (its comments say what each needs); the
    download's token, shm, env and a NetworkPolicy that admits its own namespace's training jobs."""
    (document,) = [d for d in yaml.safe_load_all(EXAMPLES[1].read_text()) if d["kind"] == "Eagle3Target"]
    spec = Eagle3TargetSpec.parse(document["spec"])
    assert spec.runtime_class_name is None and not spec.node_selector
    assert spec.hugging_face.token_secret_ref is not None
    assert spec.env and "shmSize" in document["spec"]
    assert spec.network_policy.enabled
    assert spec.network_policy.allowed_namespaces == [document["metadata"]["namespace"]]


def _quoted(rule: str) -> set[str]:
    return set(re.findall(r"'([^']*)'", rule))


def test_crd_refuses_exactly_what_the_operator_sets_in_the_pod():
    """The CRD's CEL lists and the typed spec's constants are the same names."""
    properties = crd_spec_schema()["properties"]
    (env_rule,) = properties["env"]["x-kubernetes-validations"]
    assert _quoted(env_rule["rule"]) == OPERATOR_ENV
    (volume_rule,) = properties["volumes"]["x-kubernetes-validations"]
    assert _quoted(volume_rule["rule"]) == OPERATOR_VOLUMES
    (mount_rule,) = properties["volumeMounts"]["x-kubernetes-validations"]
    assert _quoted(mount_rule["rule"]) - {"/"} == set(OPERATOR_MOUNT_PATHS)
    label_rule = properties["podMetadata"]["properties"]["labels"]["x-kubernetes-validations"][0]
    assert _quoted(label_rule["rule"]) == set(OPERATOR_LABEL_KEYS)


@pytest.mark.parametrize("name", sorted(OPERATOR_ENV))
def test_every_operator_env_name_is_refused(name):
    with pytest.raises(InvalidSpec, match="set by the operator"):
        Eagle3TargetSpec.parse(pvc_spec(env=[{"name": name, "value": "x"}]))


@pytest.mark.parametrize(
    ("path", "refused"),
    [
        *(("/models", True), ("/models/cache", True), ("/", True), ("/var/run", True), ("/dev", True)),
        *(("/models2", False), ("/cache", False), ("/var/run/other", False), ("/dev/shm2", False)),
    ],
)
def test_mounts_stay_clear_of_the_operators(path, refused):
    spec = pvc_spec(volumes=[{"name": "v", "emptyDir": {}}], volumeMounts=[{"name": "v", "mountPath": path}])
    if refused:
        with pytest.raises(InvalidSpec, match="overlaps a path the operator mounts"):
            Eagle3TargetSpec.parse(spec)
    else:
        assert Eagle3TargetSpec.parse(spec).volume_mounts[0].mount_path == path


def test_volumes_keep_their_source_as_given():
    volume = {"name": "nvme", "hostPath": {"path": "/mnt/nvme", "type": "Directory"}}
    spec = Eagle3TargetSpec.parse(pvc_spec(volumes=[volume]))
    assert spec.volumes[0].model_dump(by_alias=True) == volume


def test_fields_of_a_newer_crd_are_ignored_and_named():
    """A newer CRD can default a new field into every stored target: an older operator keeps serving it."""
    raw = pvc_spec(
        canary={"steps": 2},
        tolerations=[{"key": "a", "operator": "Exists", "matchExpiry": "1h"}],
        monitoring={"podMonitor": {"enabled": True, "scrapeTimeout": "5s"}},
    )
    raw["model"]["source"]["pvc"]["readOnlyMode"] = "strict"
    spec = Eagle3TargetSpec.parse(raw)
    assert spec.monitoring.pod_monitor.enabled and spec.tolerations[0].key == "a"
    assert unknown_fields(raw) == [
        "spec.model.source.pvc.readOnlyMode",
        "spec.canary",
        "spec.tolerations[0].matchExpiry",
        "spec.monitoring.podMonitor.scrapeTimeout",
    ]
    assert unknown_fields(pvc_spec(affinity={"anything": {"goes": 1}}, engineArgs={"x": "1"})) == []
