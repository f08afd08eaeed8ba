"""The core/v1 settings a target passes through to its server pods: resources, scheduling, env, volumes,
metadata, identity.

Each mirrors its Kubernetes type closely enough to be checked before anything is rendered, and refuses what
would collide with what the operator sets itself (its mount paths, labels, the GPU count that
tensorParallelSize decides; spec.py refuses its env and volume names); the API server checks the rest when
the Deployment is applied.
"""

import re
from typing import Annotated, Any, Literal, Self

from pydantic import AfterValidator, ConfigDict, Field, field_validator, model_validator

from eagle3_operator.constants import DEFAULT_CONTAINER_ANNOTATION, OPERATOR_LABEL_KEYS, OPERATOR_MOUNT_PATHS
from eagle3_operator.spec_fields import DNSName, Quantity, SpecModel

GPU_RESOURCE = "nvidia.com/gpu"
# Kubernetes' resource.Quantity grammar (the pattern generated CRDs use for quantities).
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
# A volume's name: a DNS-1123 label, as core/v1 requires.
VolumeName = Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")]
# A label or annotation key: an optional DNS-subdomain prefix and a name (core/v1's qualified name).
QUALIFIED_NAME_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"


def _check_label_key(key: str) -> str:
    """A label key a user may set on a child: a qualified name, not one of the operator's own."""
    if not re.match(QUALIFIED_NAME_PATTERN, key) or len(key) > 316:
        raise ValueError(f"key {key!r} is not a qualified name such as example.com/team")
    if key in OPERATOR_LABEL_KEYS:
        raise ValueError(f"key {key!r} is set by the operator")
    return key


def _check_label_value(value: str) -> str:
    if len(value) > 63 or not re.match(LABEL_VALUE_PATTERN, value):
        raise ValueError(f"{value!r} is not a label value (63 letters, digits, '-', '_', '.')")
    return value


# Labels a user may set on a child (the spec's, the operator's --pod-monitor-label): checked once, here.
LabelKey = Annotated[str, AfterValidator(_check_label_key)]
LabelValue = Annotated[str, AfterValidator(_check_label_value)]
Labels = dict[LabelKey, LabelValue]


class ResourceRequirements(SpecModel):
    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)

    @field_validator("requests", "limits")
    @classmethod
    def _quantities(cls, value: dict[str, str | int]) -> dict[str, str | int]:
        for name, quantity in value.items():
            if not re.match(QUANTITY_PATTERN, str(quantity)):
                raise ValueError(f"{name}: {quantity!r} is not a Kubernetes quantity (e.g. 500m, 16Gi)")
        return value


def _without_gpus(field: str, why: str) -> AfterValidator:
    """Refuses GPUs in a field's resources, saying which field and where its GPUs come from instead."""

    def check(resources: ResourceRequirements) -> ResourceRequirements:
        if GPU_RESOURCE in {*resources.requests, *resources.limits}:
            raise ValueError(f"{field} must not ask for {GPU_RESOURCE}; {why}")
        return resources

    return AfterValidator(check)


# The server's resources (its GPU count is tensorParallelSize's) and the hydration Job's download's.
ServerResources = Annotated[
    ResourceRequirements, _without_gpus("resources", "it comes from tensorParallelSize")
]
DownloadResources = Annotated[
    ResourceRequirements, _without_gpus("huggingFace.resources", "the download needs no GPU")
]


class Toleration(SpecModel):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class LocalObjectReference(SpecModel):
    name: DNSName


class EnvVar(SpecModel):
    """A core/v1 EnvVar for the server container (spec.env) or the download (huggingFace.env); `valueFrom` is
    checked by the API server on the pod."""

    name: str = Field(min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    value: str | None = None
    value_from: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_value(self) -> Self:
        if self.value is not None and self.value_from is not None:
            raise ValueError("set value or valueFrom, not both")
        return self


class Volume(SpecModel):
    """A core/v1 Volume: the name is checked here, the source (emptyDir, a claim, ...) by the API."""

    model_config = ConfigDict(extra="allow")

    name: VolumeName


class VolumeMount(SpecModel):
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


class PodMetadata(SpecModel):
    """Extra labels and annotations for the server pods (e.g. Kueue's queue name, a mesh opt-out)."""

    labels: Labels = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    @field_validator("annotations")
    @classmethod
    def _annotation_keys(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not re.match(QUALIFIED_NAME_PATTERN, key) or len(key) > 316:
                raise ValueError(f"key {key!r} is not a qualified name such as example.com/team")
            if key == DEFAULT_CONTAINER_ANNOTATION:
                raise ValueError(f"key {key!r} is set by the operator")
        return value


class LabelSelectorRequirement(SpecModel):
    key: str = Field(min_length=1, max_length=316)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _values_match_operator(self) -> Self:
        if (self.operator in ("In", "NotIn")) != bool(self.values):
            raise ValueError("In and NotIn need values; Exists and DoesNotExist take none")
        return self


class LabelSelector(SpecModel):
    match_labels: dict[str, str] = Field(default_factory=dict)
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list)


class TopologySpreadConstraint(SpecModel):
    """A core/v1 TopologySpreadConstraint; without a labelSelector it spreads this target's pods."""

    max_skew: int = Field(ge=1)
    topology_key: str = Field(min_length=1, max_length=316)
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"]
    label_selector: LabelSelector | None = None
    min_domains: int | None = Field(None, ge=1)
    node_affinity_policy: Literal["Honor", "Ignore"] | None = None
    node_taints_policy: Literal["Honor", "Ignore"] | None = None
    match_label_keys: list[str] = Field(default_factory=list)


class PodSecurity(SpecModel):
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
