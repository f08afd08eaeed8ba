"""Typed view of an `Eagle3Target` spec.

The CRD (crds/eagle3targets.eagle3.dev.yaml) is the first line of validation; these models mirror it so the
renderer works on checked, typed values and so a spec that reached the operator without the CRD's checks
(an older CRD, a unit test) still fails with a readable `InvalidSpec` instead of a broken Deployment.
Field names and defaults match the CRD exactly; tests/eagle3_operator/test_spec.py keeps them in step.
"""

import re
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

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
Quantity = Annotated[str | int, Field(union_mode="left_to_right")]


class InvalidSpec(ValueError):
    """The spec cannot be rendered; the message says which field and why, for status and events."""


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


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


class AuthSpec(_Model):
    token_secret_ref: SecretKeyRef


class PodMonitorSpec(_Model):
    enabled: bool = False
    interval: str = Field("30s", pattern=r"^([0-9]+(ms|s|m|h))+$")
    labels: dict[str, str] = Field(default_factory=dict)


class MonitoringSpec(_Model):
    pod_monitor: PodMonitorSpec = Field(default_factory=PodMonitorSpec)


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
        if self.engine == "vllm" and self.tensor_parallel_size < 1:
            raise ValueError("engine vllm needs GPUs: tensorParallelSize must be >= 1 (0 is for engine hf)")
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


def _describe(error: ValidationError) -> str:
    problems = []
    for detail in error.errors():
        path = ".".join(str(part) for part in ("spec", *detail["loc"]))
        message = detail["msg"].removeprefix("Value error, ")
        problems.append(f"{path}: {message}")
    return "; ".join(problems)
