"""What kopf's indexes keep for the reconciler: one snapshot per target and one state per owned child.

handlers.py fills the indexes from kopf's watches; a reconcile pass reads only them (and the prober's
results), so these records hold just what a pass needs: a target's spec, status and identity, and of each
child what drift compares and how far a Deployment or Job has come. Pods are indexed as PodViews
(status/observation.py).
"""

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from eagle3_target.protocol import GROUP, KIND

from eagle3_operator.status.observation import DeploymentView, JobView
from eagle3_operator.status.observe import deployment_view, job_view

T = TypeVar("T")

TargetKey = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True)
class TargetSnapshot:
    """What the target index keeps per Eagle3Target."""

    uid: str
    generation: int
    resource_version: str
    spec: Mapping[str, Any]
    status: Mapping[str, Any]
    deleting: bool
    upgrade: str | None = None  # the target's constants.ANNOTATION_UPGRADE
    wake: str | None = None  # the target's protocol.ANNOTATION_WAKE_REQUESTED


@dataclass(frozen=True)
class ChildState:
    """What a child index keeps per owned object: enough to detect drift, and the Deployment's progress."""

    api_version: str
    kind: str
    name: str
    uid: str
    resource_version: str
    owner_uid: str
    essence: Mapping[str, Any]  # metadata labels/annotations/ownerReferences and spec: what drift compares
    deployment: DeploymentView | None = None
    job: JobView | None = None
    deleting: bool = False  # a deletion has begun (deletionTimestamp): it waits on finalizers or dependents


def controlling_target(metadata: Mapping[str, Any]) -> tuple[str, str] | None:
    """The controlling Eagle3Target's (name, uid), if the object is one of a target's children."""
    for ref in metadata.get("ownerReferences") or []:
        if (
            ref.get("kind") == KIND
            and ref.get("controller")
            and ref.get("apiVersion", "").startswith(f"{GROUP}/")
        ):
            return ref["name"], ref["uid"]
    return None


def child_state(body: Mapping[str, Any], owner_uid: str) -> ChildState:
    metadata = body["metadata"]
    return ChildState(
        api_version=body["apiVersion"],
        kind=body["kind"],
        name=metadata["name"],
        uid=metadata["uid"],
        resource_version=metadata.get("resourceVersion", ""),
        owner_uid=owner_uid,
        essence=copy.deepcopy(essence(body)),
        deployment=deployment_view(body) if body["kind"] == "Deployment" else None,
        job=job_view(body) if body["kind"] == "Job" else None,
        deleting=bool(metadata.get("deletionTimestamp")),
    )


def essence(body: Mapping[str, Any]) -> dict[str, Any]:
    metadata = body.get("metadata") or {}
    kept = {k: metadata[k] for k in ("labels", "annotations", "ownerReferences") if k in metadata}
    return {"metadata": kept, "spec": body.get("spec") or {}}


def only(values: Iterable[T] | None) -> T | None:
    """The single value a kopf index holds under a key (None if nothing is indexed there)."""
    return next(iter(values), None) if values is not None else None
