"""Typed view of an `Eagle3Target` spec.

The CRD (crds/eagle3targets.eagle3.dev.yaml) is the first line of validation; these models mirror it so the
renderer works on checked, typed values and so a spec that reached the operator without the CRD's checks
(an older CRD, a unit test) still fails with a readable `InvalidSpec` instead of a broken Deployment.
Field names and defaults match the CRD exactly; tests/eagle3_operator/test_spec.py keeps them in step.

This module holds the target's own fields, the rules across them and the parsing; the models it nests
live in spec_model_source.py (which model, and where its weights come from) and spec_pod_settings.py (the
core/v1 settings passed through to the server pods), all on spec_fields.py's base.

Fields this operator does not know are ignored, not refused: a newer CRD may add (and default) fields
that the API server fills into every stored target, and an older operator must keep serving those
targets. `unknown_fields` names them so the operator can warn.
"""

import re
import types
from collections.abc import Mapping
from typing import Annotated, Any, Self, Union, get_args, get_origin

from eagle3_target.engines import ENGINES, EngineName
from eagle3_target.protocol import MAX_CAPTURE_LAYERS
from kubernetes.utils import parse_quantity
from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator, model_validator

from eagle3_operator.constants import OPERATOR_ENV, OPERATOR_VOLUMES
from eagle3_operator.spec_fields import DNSName, Quantity, SpecModel
from eagle3_operator.spec_model_source import HuggingFaceSource, ModelSource, ModelSpec, SecretKeyRef
from eagle3_operator.spec_pod_settings import (
    EnvVar,
    Labels,
    LabelSelector,
    LocalObjectReference,
    PodMetadata,
    PodSecurity,
    ResourceRequirements,
    ServerResources,
    Toleration,
    TopologySpreadConstraint,
    Volume,
    VolumeMount,
)

ENGINE_ARG_KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
# Server flags the typed fields own; an engineArgs entry must not override them behind the spec's back.
RESERVED_ENGINE_ARGS = frozenset(
    {"model", "dtype", "tensor-parallel-size", "max-model-len", "port", "host", "trust-remote-code"}
)
# A decoder layer's id (HF convention: id i is the output of decoder layer i), within the CRD's bound: the
# model's own depth is known only to the server, which refuses ids beyond it at start.
LayerId = Annotated[int, Field(ge=0, le=1024)]
# maxSurge / maxUnavailable: a pod count or a percentage of replicas.
IntOrPercent = Annotated[int | str, Field(union_mode="left_to_right")]
PERCENT_PATTERN = r"^[0-9]+%$"

# /dev/shm for NCCL's shared-memory transport between the GPUs of one pod and vLLM's inter-process queues:
# 16Gi covers tensor parallelism across 8 GPUs with room to spare. It is a ceiling, not a reservation, but
# what is written there counts against the pod's memory.
DEFAULT_SHM_SIZE = "16Gi"


class InvalidSpec(ValueError):
    """The spec cannot be rendered; the message says which field and why, for status and events."""


class RolloutSpec(SpecModel):
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


class AuthSpec(SpecModel):
    token_secret_ref: SecretKeyRef


class NetworkPolicySpec(SpecModel):
    """Who may reach the server: its data routes return a frontier model's internals."""

    enabled: bool = False
    allowed_namespaces: list[
        Annotated[str, Field(max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")]
    ] = Field(default_factory=list)
    namespace_selector: LabelSelector | None = None


class PodMonitorSpec(SpecModel):
    enabled: bool = False
    interval: str = Field("30s", pattern=r"^([0-9]+(ms|s|m|h))+$")
    # What the cluster's Prometheus selects PodMonitors by (kube-prometheus-stack: release).
    labels: Labels = Field(default_factory=dict, max_length=32)


class MonitoringSpec(SpecModel):
    pod_monitor: PodMonitorSpec = Field(default_factory=PodMonitorSpec)
    metrics_port: int = Field(9090, ge=1024, le=65535)


# A Go-style duration of whole units: 2h, 90m, 1h30m, 45s.
DURATION_PATTERN = r"^([0-9]+(s|m|h))+$"
DURATION_UNITS = {"s": 1, "m": 60, "h": 3600}
# The shortest idle window: short enough for tests, long enough that one probe period cannot decide it.
MIN_SCALE_TO_ZERO_SECONDS = 5


def duration_seconds(duration: str) -> int:
    """Seconds in a DURATION_PATTERN duration."""
    return sum(int(n) * DURATION_UNITS[unit] for n, unit in re.findall(r"([0-9]+)([smh])", duration))


class IdleSpec(SpecModel):
    """When a target nobody pulls from gives its GPUs back (status/idle.py)."""

    scale_to_zero_after: str | None = Field(None, pattern=DURATION_PATTERN)

    @field_validator("scale_to_zero_after")
    @classmethod
    def _long_enough(cls, value: str | None) -> str | None:
        if value is not None and duration_seconds(value) < MIN_SCALE_TO_ZERO_SECONDS:
            raise ValueError(f"must be at least {MIN_SCALE_TO_ZERO_SECONDS}s")
        return value

    @property
    def after_seconds(self) -> int | None:
        """The idle window in seconds; None: never scale to zero."""
        return duration_seconds(self.scale_to_zero_after) if self.scale_to_zero_after else None


class EndpointSpec(SpecModel):
    url: str = Field(pattern=r"^https?://[^\s/]+(/\S*)?$", max_length=2048)


class Eagle3TargetSpec(SpecModel):
    model: ModelSpec | None = None
    engine: EngineName = "vllm"
    aux_layer_ids: list[LayerId] | None = None
    capture_layer_ids: list[LayerId] | None = Field(None, min_length=1, max_length=MAX_CAPTURE_LAYERS)
    tensor_parallel_size: int = Field(1, ge=0, le=16)
    replicas: int = Field(1, ge=0, le=64)
    suspend: bool = False
    max_model_len: int | None = Field(None, ge=1)
    engine_args: dict[str, str] = Field(default_factory=dict)
    image: str | None = Field(None, min_length=1)
    resources: ServerResources = Field(default_factory=ResourceRequirements)
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
    idle: IdleSpec = Field(default_factory=IdleSpec)

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

    @field_validator("capture_layer_ids")
    @classmethod
    def _distinct(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError("must be distinct decoder-layer ids")
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
        if self.endpoint is not None and self.idle.scale_to_zero_after is not None:
            raise ValueError(
                "idle.scaleToZeroAfter scales pods the operator runs; an endpoint.url target has none"
            )
        if self.aux_layer_ids is not None and self.capture_layer_ids is not None:
            missing = [i for i in self.aux_layer_ids if i not in self.capture_layer_ids]
            if missing:
                raise ValueError(
                    f"every auxLayerIds id must be in captureLayerIds (the EAGLE-3 aux layers are part of "
                    f"the capture set); it lacks {missing}"
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
