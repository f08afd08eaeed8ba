"""Which model a managed target serves and where its weights come from: a claim, a host path, or the Hub.

A Hub source is downloaded once into a cache claim by the target's hydration Job before the server pods
start; the others are mounted as they are.
"""

from typing import Literal, Self

from pydantic import Field, field_validator, model_validator

from eagle3_operator.constants import HYDRATION_ENV, OPERATOR_ENV_PREFIX
from eagle3_operator.spec_fields import DNSName, SpecModel
from eagle3_operator.spec_pod_settings import DownloadResources, EnvVar

HF_REPO_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$"
HF_REVISION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)*$"


class SecretKeyRef(SpecModel):
    name: DNSName
    key: str = Field("token", min_length=1, max_length=253)


class PvcSource(SpecModel):
    claim_name: DNSName
    sub_path: str | None = Field(None, pattern=r"^[^/].*$")

    @field_validator("sub_path")
    @classmethod
    def _no_parent_dirs(cls, value: str | None) -> str | None:
        if value is not None and ".." in value.split("/"):
            raise ValueError("must not contain '..'")
        return value


class HostPathSource(SpecModel):
    path: str = Field(pattern=r"^/")


class HuggingFaceSource(SpecModel):
    repo: str = Field(pattern=HF_REPO_PATTERN, max_length=200)
    revision: str | None = Field(None, pattern=HF_REVISION_PATTERN, max_length=200)
    token_secret_ref: SecretKeyRef | None = None
    cache_claim_name: DNSName
    # The download's reach (a mirror, a proxy) and size: not what is downloaded, so not the Job's name.
    env: list[EnvVar] = Field(default_factory=list, max_length=32)
    resources: DownloadResources | None = None

    @field_validator("env")
    @classmethod
    def _names_clear_of_the_operators(cls, value: list[EnvVar]) -> list[EnvVar]:
        names = [var.name for var in value]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"name must be unique; repeated: {', '.join(repeated)}")
        taken = sorted(n for n in names if n in HYDRATION_ENV or n.startswith(OPERATOR_ENV_PREFIX))
        if taken:
            raise ValueError(f"{', '.join(taken)}: set by the operator (HF_TOKEN from tokenSecretRef)")
        return value


class ModelSource(SpecModel):
    pvc: PvcSource | None = None
    host_path: HostPathSource | None = None
    hugging_face: HuggingFaceSource | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> Self:
        if sum(s is not None for s in (self.pvc, self.host_path, self.hugging_face)) != 1:
            raise ValueError("exactly one of pvc, hostPath, huggingFace must be set")
        return self


class ModelSpec(SpecModel):
    name: str = Field(min_length=1, max_length=253)
    # Also the default download revision, and so a path component of the model cache: a Hub revision name.
    revision: str | None = Field(None, pattern=HF_REVISION_PATTERN, max_length=200)
    source: ModelSource | None = None
    dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = None
    trust_remote_code: bool = False
