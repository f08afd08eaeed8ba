"""Specs and rendered children for the renderer's tests (tests/eagle3_operator/render/), one set of shortcuts
so each test states only the fields it checks."""

import re
from typing import Any

from eagle3_operator.render.children import build_children
from eagle3_operator.spec import Eagle3TargetSpec

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
UID = "0b6f7f4e-5a1c-4d53-9d0e-1f2a3b4c5d6e"
HF_SOURCE = {"huggingFace": {"repo": "org/tiny-model", "cacheClaimName": "hf-cache"}}
LONG_NAME = "a-very-long-target-name-for-a-llama-3.1-405b-instruct-fp8-target-in-the-research-namespace"


def make_spec(source: dict[str, Any] | None = None, **fields: Any) -> Eagle3TargetSpec:
    model = {"name": "org/tiny-model", "source": source or {"pvc": {"claimName": "models"}}}
    return Eagle3TargetSpec.parse({"model": model, **fields})


def children(
    spec: Eagle3TargetSpec, name: str = "tiny", namespace: str = "ml", **kwargs: Any
) -> dict[str, dict[str, Any]]:
    rendered = build_children(name, namespace, UID, spec, pod_monitor_supported=True, **kwargs)
    return {child["kind"]: child for child in rendered}


def pod_of(spec: Eagle3TargetSpec) -> dict[str, Any]:
    return children(spec)["Deployment"]["spec"]["template"]["spec"]


def server_of(spec: Eagle3TargetSpec) -> dict[str, Any]:
    (container,) = pod_of(spec)["containers"]
    return container


def job_of(spec: Eagle3TargetSpec, name: str = "tiny") -> dict[str, Any]:
    return children(spec, name)["Job"]


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]
