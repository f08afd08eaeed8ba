"""Typed view of an `Eagle3Target` spec.

The CRD (crds/eagle3targets.eagle3.dev.yaml) is the first line of validation; these models mirror it so the
renderer works on checked, typed values and so a spec that reached the operator without the CRD's checks
(an older CRD, a unit test) still fails with a readable `InvalidSpec` instead of a broken Deployment.
Field names and defaults match the CRD exactly; tests/eagle3_operator/test_spec.py keeps them in step.

Fields this operator does not know are ignored, not refused: a newer CRD may add (and default) fields
that the API server fills into every stored target, and an older operator must keep serving those
targets. `unknown_fields` names them so the operator can warn.
"""

import re
import types
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Self, Union, get_args, get_origin

from eagle3_target.engines import ENGINES
from kubernetes.utils import parse_quantity
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from eagle3_operator.constants import (
    DEFAULT_CONTAINER_ANNOTATION,
    OPERATOR_ENV,
    OPERATOR_LABEL_KEYS,
    OPERATOR_MOUNT_PATHS,
    OPERATOR_VOLUMES,
)

# Kubernetes' resource.Quantity grammar (the pattern generated CRDs use for quantities).
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
ENGINE_ARG_KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
HF_REPO_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$"
HF_REVISION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)*$"
GPU_RESOURCE = "nvidia.com/gpu"
# Server flags the typed fields own; an engineArgs entry must not override them behind the spec's back.
RESERVED_ENGINE_ARGS = frozenset(
    {"model", "dtype", "tensor-parallel-size", "max-model-len", "port", "host", "trust-remote-code"}
)

DNSName = Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")]
# A volume's name: a DNS-1123 label, as core/v1 requires.
VolumeName = Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")]
Quantity = Annotated[str | int, Field(union_mode="left_to_right")]
# maxSurge / maxUnavailable: a pod count or a percentage of replicas.
IntOrPercent = Annotated[int | str, Field(union_mode="left_to_right")]
PERCENT_PATTERN = r"^[0-9]+%$"
# A label or annotation key: an optional DNS-subdomain prefix and a name (core/v1's qualified name).
QUALIFIED_NAME_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"

# /dev/shm for NCCL's shared-memory transport between the GPUs of one pod and vLLM's inter-process queues:
# 16Gi covers tensor parallelism across 8 GPUs with room to spare. It is a ceiling, not a reservation, but
# what is written there counts against the pod's memory.
DEFAULT_SHM_SIZE = "16Gi"


class InvalidSpec(ValueError):
    """The spec cannot be rendered; the message says which field and why, for status and events."""


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)


class SecretKeyRef(_Model):
    name: DNSName
    key: str = Field("token", min_length=1, max_length=253)


class PvcSource(_Model):
    claim_name: DNSName
    sub_path: str | None = Field(None, pattern=r"^[^/].*$")

    @field_validator("sub_path")
    @classmethod
    def _no_parent_dirs(cls, value: str | None) -> str | None:
        if value is not None and ".." in value.split("/"):
            raise ValueError("must not contain '..'")
        return value


class HostPathSource(_Model):
    path: str = Field(pattern=r"^/")


class HuggingFaceSource(_Model):
    repo: str = Field(pattern=HF_REPO_PATTERN, max_length=200)
    revision: str | None = Field(None, pattern=HF_REVISION_PATTERN, max_length=200)
    token_secret_ref: SecretKeyRef | None = None
    cache_claim_name: DNSName


class ModelSource(_Model):
    pvc: PvcSource | None = None
    host_path: HostPathSource | None = None
    hugging_face: HuggingFaceSource | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> Self:
        if sum(s is not None for s in (self.pvc, self.host_path, self.hugging_face)) != 1:
            raise ValueError("exactly one of pvc, hostPath, huggingFace must be set")
        return self


class ModelSpec(_Model):
    name: str = Field(min_length=1, max_length=253)
    revision: str | None = Field(None, max_length=200)
    source: ModelSource | None = None
    dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = None
    trust_remote_code: bool = False


class ResourceRequirements(_Model):
    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)

    @field_validator("requests", "limits")
    @classmethod
    def _quantities(cls, value: dict[str, str | int]) -> dict[str, str | int]:
        for name, quantity in value.items():
            if name == GPU_RESOURCE:
                raise ValueError(f"{GPU_RESOURCE} comes from tensorParallelSize; do not set it here")
            if not re.match(QUANTITY_PATTERN, str(quantity)):
                raise ValueError(f"{name}: {quantity!r} is not a Kubernetes quantity (e.g. 500m, 16Gi)")
        return value


class Toleration(_Model):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class LocalObjectReference(_Model):
    name: DNSName


class EnvVar(_Model):
    """A core/v1 EnvVar for the server container; `valueFrom` is checked by the API server on the pod."""

    name: str = Field(min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    value: str | None = None
    value_from: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_value(self) -> Self:
        if self.value is not None and self.value_from is not None:
            raise ValueError("set value or valueFrom, not both")
        return self


class Volume(_Model):
    """A core/v1 Volume: the name is checked here, the source (emptyDir, a claim, ...) by the API."""

    model_config = ConfigDict(extra="allow")

    name: VolumeName


class VolumeMount(_Model):
    name: VolumeName
    mount_path: str = Field(min_length=1, max_length=4096, pattern=r"^/")
    read_only: bool | None = None
    sub_path: str | None = Field(None, max_length=1024)
    sub_path_expr: str | None = Field(None, max_length=1024)
    mount_propagation: Literal["None", "HostToContainer", "Bidirectional"] | None = None
    recursive_read_only: Literal["Disabled", "IfPossible", "Enabled"] | None = None

    @field_validator("mount_path")
    @classmethod
    def _clear_of_operator_mounts(cls, value: str) -> str:
        if any(_overlaps(value, path) for path in OPERATOR_MOUNT_PATHS):
            raise ValueError(
                f"{value} overlaps a path the operator mounts ({', '.join(OPERATOR_MOUNT_PATHS)})"
            )
        return value


def _overlaps(path: str, other: str) -> bool:
    """Whether mounting at `path` would hide or land inside `other` (or is it)."""
    path, other = path.rstrip("/") or "/", other.rstrip("/")
    return path == other or other.startswith(f"{path.rstrip('/')}/") or path.startswith(f"{other}/")


class PodMetadata(_Model):
    """Extra labels and annotations for the server pods (e.g. Kueue's queue name, a mesh opt-out)."""

    labels: dict[str, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]] = Field(
        default_factory=dict
    )
    annotations: dict[str, str] = Field(default_factory=dict)

    @field_validator("labels", "annotations")
    @classmethod
    def _keys(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        reserved = OPERATOR_LABEL_KEYS if info.field_name == "labels" else (DEFAULT_CONTAINER_ANNOTATION,)
        for key in value:
            if not re.match(QUALIFIED_NAME_PATTERN, key) or len(key) > 316:
                raise ValueError(f"key {key!r} is not a qualified name such as example.com/team")
            if key in reserved:
                raise ValueError(f"key {key!r} is set by the operator")
        return value


class LabelSelectorRequirement(_Model):
    key: str = Field(min_length=1, max_length=316)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _values_match_operator(self) -> Self:
        if (self.operator in ("In", "NotIn")) != bool(self.values):
            raise ValueError("In and NotIn need values; Exists and DoesNotExist take none")
        return self


class LabelSelector(_Model):
    match_labels: dict[str, str] = Field(default_factory=dict)
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list)


class TopologySpreadConstraint(_Model):
    """A core/v1 TopologySpreadConstraint; without a labelSelector it spreads this target's pods."""

    max_skew: int = Field(ge=1)
    topology_key: str = Field(min_length=1, max_length=316)
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"]
    label_selector: LabelSelector | None = None
    min_domains: int | None = Field(None, ge=1)
    node_affinity_policy: Literal["Honor", "Ignore"] | None = None
    node_taints_policy: Literal["Honor", "Ignore"] | None = None
    match_label_keys: list[str] = Field(default_factory=list)


class PodSecurity(_Model):
    """Which user and groups the server runs as: the image's own (10001, group 0) unless set here, or none
    at all with `platformAssignedIds`, so OpenShift's restricted SCC assigns them from the namespace."""

    run_as_user: int | None = Field(None, ge=1, le=2147483647)
    run_as_group: int | None = Field(None, ge=0, le=2147483647)
    fs_group: int | None = Field(None, ge=0, le=2147483647)
    platform_assigned_ids: bool = False

    @model_validator(mode="after")
    def _ids_or_platform(self) -> Self:
        if self.platform_assigned_ids and (
            self.run_as_user is not None or self.run_as_group is not None or self.fs_group is not None
        ):
            raise ValueError("platformAssignedIds leaves the ids to the platform; do not set them too")
        return self


class RolloutSpec(_Model):
    """The Deployment's rolling update; the defaults never ask for a GPU beyond the replicas' own."""

    max_surge: IntOrPercent = 0
    max_unavailable: IntOrPercent = 1

    @field_validator("max_surge", "max_unavailable")
    @classmethod
    def _count_or_percent(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError("must not be negative")
        if isinstance(value, str) and not re.match(PERCENT_PATTERN, value):
            raise ValueError(f"{value!r} must be a pod count or a percentage such as 25%")
        return value

    @model_validator(mode="after")
    def _can_progress(self) -> Self:
        if _zero(self.max_surge) and _zero(self.max_unavailable):
            raise ValueError("maxSurge and maxUnavailable must not both be 0: the rollout could never start")
        return self


def _zero(value: int | str) -> bool:
    return value in (0, "0%")


class AuthSpec(_Model):
    token_secret_ref: SecretKeyRef


class NetworkPolicySpec(_Model):
    """Who may reach the server: its data routes return a frontier model's internals."""

    enabled: bool = False
    allowed_namespaces: list[
        Annotated[str, Field(max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")]
    ] = Field(default_factory=list)
    namespace_selector: LabelSelector | None = None


class PodMonitorSpec(_Model):
    enabled: bool = False
    interval: str = Field("30s", pattern=r"^([0-9]+(ms|s|m|h))+$")
    labels: dict[str, str] = Field(default_factory=dict)


class MonitoringSpec(_Model):
    pod_monitor: PodMonitorSpec = Field(default_factory=PodMonitorSpec)
    metrics_port: int = Field(9090, ge=1024, le=65535)


class EndpointSpec(_Model):
    url: str = Field(pattern=r"^https?://[^\s/]+(/\S*)?$", max_length=2048)


class Eagle3TargetSpec(_Model):
    model: ModelSpec | None = None
    engine: Literal["vllm", "hf"] = "vllm"
    aux_layer_ids: list[Annotated[int, Field(ge=0, le=1024)]] | None = None
    tensor_parallel_size: int = Field(1, ge=0, le=16)
    replicas: int = Field(1, ge=0, le=64)
    suspend: bool = False
    max_model_len: int | None = Field(None, ge=1)
    engine_args: dict[str, str] = Field(default_factory=dict)
    image: str | None = Field(None, min_length=1)
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    affinity: dict[str, Any] | None = None
    priority_class_name: str | None = None
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list)
    startup_timeout_seconds: int = Field(1800, ge=30, le=86400)
    port: int = Field(8000, ge=1024, le=65535)
    auth: AuthSpec | None = None
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)
    endpoint: EndpointSpec | None = None
    env: list[EnvVar] = Field(default_factory=list)
    volumes: list[Volume] = Field(default_factory=list)
    volume_mounts: list[VolumeMount] = Field(default_factory=list)
    pod_metadata: PodMetadata = Field(default_factory=PodMetadata)
    runtime_class_name: DNSName | None = None
    service_account_name: DNSName | None = None
    scheduler_name: str | None = Field(None, min_length=1, max_length=253)
    topology_spread_constraints: list[TopologySpreadConstraint] = Field(default_factory=list)
    shm_size: Quantity = DEFAULT_SHM_SIZE
    security_context: PodSecurity = Field(default_factory=PodSecurity)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)

    @property
    def managed_model(self) -> ModelSpec:
        """The model of a target the operator runs; the validator gives every non-external target a source."""
        if self.model is None or self.model.source is None:
            raise ValueError("an external target (endpoint.url) has no model for the operator to run")
        return self.model

    @property
    def source(self) -> ModelSource:
        """Where a managed target's model comes from (see `managed_model`)."""
        source = self.managed_model.source
        assert source is not None  # managed_model checked it
        return source

    @property
    def hugging_face(self) -> HuggingFaceSource:
        """The huggingFace source of a managed target that downloads its model."""
        source = self.source.hugging_face
        if source is None:
            raise ValueError("the model source is not huggingFace")
        return source

    @field_validator("env", "volumes")
    @classmethod
    def _names_clear_of_the_operators(
        cls, value: list[EnvVar] | list[Volume], info: ValidationInfo
    ) -> list[EnvVar] | list[Volume]:
        names = [item.name for item in value]
        _unique("name", names)
        if info.field_name == "env":
            reserved, why = OPERATOR_ENV, "set by the operator from the spec's own fields"
        else:
            reserved, why = OPERATOR_VOLUMES, "the operator's own volume names"
        taken = sorted(set(names) & reserved)
        if taken:
            raise ValueError(f"{', '.join(taken)}: {why}")
        return value

    @field_validator("volume_mounts")
    @classmethod
    def _mount_paths(cls, value: list[VolumeMount]) -> list[VolumeMount]:
        _unique("mountPath", [mount.mount_path for mount in value])
        return value

    @field_validator("shm_size")
    @classmethod
    def _shm_quantity(cls, value: str | int) -> str | int:
        try:
            positive = parse_quantity(value) > 0
        except ValueError:
            positive = False
        if not positive:
            raise ValueError(f"{value!r} is not a positive Kubernetes quantity (e.g. 16Gi)")
        return value

    @field_validator("aux_layer_ids")
    @classmethod
    def _three_distinct(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (len(value) != 3 or len(set(value)) != 3):
            raise ValueError("must be exactly 3 distinct decoder-layer ids")
        return value

    @field_validator("engine_args")
    @classmethod
    def _engine_arg_keys(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not re.match(ENGINE_ARG_KEY_PATTERN, key):
                raise ValueError(f"key {key!r} must be a flag name such as gpu-memory-utilization")
            if key.replace("_", "-") in RESERVED_ENGINE_ARGS:
                raise ValueError(f"key {key!r} is set by a typed field of the spec; use that field instead")
        return value

    @model_validator(mode="after")
    def _cross_field(self) -> Self:
        has_source = self.model is not None and self.model.source is not None
        if self.endpoint is not None and has_source:
            raise ValueError("endpoint.url (an external server) and model.source are mutually exclusive")
        if self.endpoint is None and not has_source:
            raise ValueError(
                "model.source (pvc, hostPath or huggingFace) is required unless endpoint.url is set"
            )
        if ENGINES[self.engine].sharded and self.tensor_parallel_size < 1:
            raise ValueError(
                f"engine {self.engine} needs GPUs: tensorParallelSize must be >= 1 (0 is for engine hf)"
            )
        if self.monitoring.metrics_port == self.port:
            raise ValueError(f"monitoring.metricsPort and port must differ (both are {self.port})")
        volumes = {volume.name for volume in self.volumes}
        unknown = sorted({mount.name for mount in self.volume_mounts} - volumes)
        if unknown:
            raise ValueError(f"volumeMounts name volumes that spec.volumes lacks: {', '.join(unknown)}")
        return self

    @property
    def external(self) -> bool:
        """True when the target is a server somewhere else: the operator runs no pods, only probes it."""
        return self.endpoint is not None

    @property
    def effective_replicas(self) -> int:
        """Pods the Deployment should run: none while suspended."""
        return 0 if self.suspend else self.replicas

    @classmethod
    def parse(cls, spec: dict[str, Any]) -> "Eagle3TargetSpec":
        """Validate a raw `.spec` (as the API server returns it); raise InvalidSpec naming every bad field."""
        try:
            return cls.model_validate(spec)
        except ValidationError as error:
            raise InvalidSpec(_describe(error)) from None


def unknown_fields(
    raw: Mapping[str, Any], model: type[BaseModel] = Eagle3TargetSpec, at: str = "spec"
) -> list[str]:
    """The paths of fields in a raw spec that this operator's models do not know (they are ignored)."""
    known = {field.alias or name: field for name, field in model.model_fields.items()}
    found = []
    for key, value in raw.items():
        field = known.get(key)
        if field is None:
            found.append(f"{at}.{key}")
            continue
        nested = _model_in(field.annotation)
        if nested is not None and isinstance(value, Mapping):
            found += unknown_fields(value, nested, f"{at}.{key}")
        elif nested is not None and isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, Mapping):
                    found += unknown_fields(item, nested, f"{at}.{key}[{index}]")
    return found


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model class a field holds (directly, optionally, or as list items), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (list, Union, types.UnionType, Annotated):
        return next((m for arg in get_args(annotation) if (m := _model_in(arg)) is not None), None)
    return None


def _unique(key: str, values: list[str]) -> None:
    repeated = sorted({value for value in values if values.count(value) > 1})
    if repeated:
        raise ValueError(f"{key} must be unique; repeated: {', '.join(repeated)}")


def _describe(error: ValidationError) -> str:
    problems = []
    for detail in error.errors():
        path = ".".join(str(part) for part in ("spec", *detail["loc"]))
        message = detail["msg"].removeprefix("Value error, ")
        problems.append(f"{path}: {message}")
    return "; ".join(problems)
