"""Bringing a target's children in line with its rendering: apply what differs, delete what should not exist.

A child is written only when it must be: its rendered digest moved, or someone else changed it (drift, as
`matches` judges it). A child the indexes do not show is read by name before it is applied, so an object this
target does not own is never taken over (NameConflict). Children of kinds without an index (PodMonitor: its
CRD may not even exist) are looked up by name once per operator process, then known from its own applies.
What a refused apply reports (the API server's refusals in the status vocabulary), and when it may be
tried again, is kept with the rest of these writes.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes.utils import parse_quantity

from eagle3_operator import metrics
from eagle3_operator.constants import CHILD_KINDS, POD_MONITOR_API_VERSION
from eagle3_operator.indexes import ChildState, TargetKey, child_state, controlling_target, essence
from eagle3_operator.kube import KubeApi, KubeError, NameConflict
from eagle3_operator.render.children import rendered_digest
from eagle3_operator.render.names import child_name
from eagle3_operator.status import reasons
from eagle3_operator.status.observation import Failure

# Children whose kind has no index (its CRD may not even exist): looked up by name once per operator
# process, then known from this process's own applies.
UNWATCHED_KINDS = frozenset(child.kind for child in CHILD_KINDS if not child.watched)

ChildKey = tuple[str, str]  # (kind, name)


def matches(desired: Any, observed: Any) -> bool:
    """Whether every field the operator renders has that value in the observed object.

    Fields the API server adds (defaults, status, clusterIP) are ignored; lists must match item by item;
    quantities compare by value (the server stores 1 GPU as "1" and 1024Mi as "1Gi").
    """
    if isinstance(desired, Mapping):
        return isinstance(observed, Mapping) and all(
            key in observed and matches(value, observed[key]) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(observed, list)
            and len(desired) == len(observed)
            and all(matches(d, o) for d, o in zip(desired, observed, strict=True))
        )
    if isinstance(desired, bool) or isinstance(observed, bool):  # True == 1 in Python, not in Kubernetes
        return type(desired) is type(observed) and desired == observed
    if desired == observed:
        return True
    if isinstance(desired, str | int) and isinstance(observed, str | int):
        try:
            return parse_quantity(desired) == parse_quantity(observed)
        except ValueError:
            return False
    return False


@dataclass
class ChildWrites:
    """What this process's own writes taught it about one target's children (lost on restart, rebuilt by a
    pass)."""

    # (kind, name) -> the resourceVersion this process's last apply left: unchanged since, it needs no check.
    applied: dict[ChildKey, str] = field(default_factory=dict)
    # What this process knows of children of UNWATCHED_KINDS (no index shows them): (kind, name) -> state,
    # None when looked up and absent. Filled by one lookup per process, then by applies.
    unwatched: dict[ChildKey, ChildState | None] = field(default_factory=dict)
    # The last refused apply: the rendering's digests, what status reports, and when (the work queue's
    # clock) it may be tried again; the pass that refused asks to run again then.
    refused: tuple[tuple[str, ...], Failure, float] | None = None

    def still_refused(self, digests: tuple[str, ...], now: float) -> tuple[Failure, float] | None:
        """The refusal to report again instead of applying, and when its retry is due: the same rendering,
        before that time."""
        if self.refused is not None and self.refused[0] == digests and now < self.refused[2]:
            return self.refused[1], self.refused[2]
        return None

    def refuse(self, digests: tuple[str, ...], failure: Failure, *, retry_at: float) -> None:
        """Remember a refused rendering: not applied again before `retry_at` unless it changes."""
        self.refused = (digests, failure, retry_at)


def apply_failure(error: KubeError | NameConflict) -> Failure:
    """What status reports when applying a child failed: a reason to act on, the server's own words.

    Admission denials (webhooks, ValidatingAdmissionPolicies) and ResourceQuotas are told apart by the
    message; other 400/422 mean the spec renders to something the API server will not take, and other
    403 is RBAC.
    """
    if isinstance(error, NameConflict):
        return Failure(reasons.NAME_CONFLICT, str(error))
    text = error.message.lower()
    if "denied the request" in text or "denied request" in text:
        reason = reasons.ADMISSION_DENIED  # a webhook (often 403) or a ValidatingAdmissionPolicy (often 422)
    elif error.status == 403 and "exceeded quota" in text:
        reason = reasons.QUOTA_EXCEEDED
    elif error.status in (400, 422):
        reason = reasons.INVALID_SPEC
    elif error.status == 403:
        reason = reasons.FORBIDDEN
    elif error.status == 409:
        reason = reasons.CONFLICT
    else:
        reason = reasons.APPLY_FAILED
    answer = f"HTTP {error.status or 'no answer'}"
    return Failure(reason, f"the API server rejected a child ({answer}): {error.message}")


class ChildApplier:
    """Reads targets' children from kopf's child indexes and writes them through the API."""

    def __init__(self, api: KubeApi, indexes: Iterable[Mapping[TargetKey, Iterable[ChildState]]]) -> None:
        """`indexes` are kopf's child indexes, one per watched kind (key → the children indexed under it)."""
        self._api = api
        self._indexes = list(indexes)

    def owned(self, key: TargetKey) -> list[ChildState]:
        """The children the indexes show for a target's name (of its current uid or an earlier one)."""
        return [child for index in self._indexes for child in index.get(key) or ()]

    async def apply(
        self,
        key: TargetKey,
        uid: str,
        desired: list[dict[str, Any]],
        writes: ChildWrites,
        *,
        monitors: bool,
        hydrated: bool,
    ) -> dict[str, dict[str, Any]]:
        """Apply each desired child that is missing or differs, delete owned children not desired; returns
        what was applied by kind. Raises KubeError or NameConflict when a write is refused."""
        namespace, name = key
        if monitors:
            await self._look_up_unwatched(namespace, name, uid, writes)
        observed: dict[ChildKey, ChildState] = {
            (child.kind, child.name): child for child in self.owned(key) if child.owner_uid == uid
        }
        observed |= {child_key: state for child_key, state in writes.unwatched.items() if state is not None}
        applied: dict[str, dict[str, Any]] = {}
        for manifest in desired:
            child_key = (manifest["kind"], manifest["metadata"]["name"])
            current = observed.pop(child_key, None)
            if manifest["kind"] == "Deployment" and not hydrated and current is not None:
                continue  # Held as is (its pods may serve a previous revision) until the download completes.
            if current is None:  # deleted, lagging, or never ours: never apply over someone else's object
                current = await self._existing(manifest, namespace, name)
            if current is not None and not _differs(manifest, current, writes):
                continue
            if current is not None and current.job is not None and _rerendered(manifest, current):
                # A Job's pod template cannot change, and its name leaves out how it downloads (a mirror,
                # a proxy, its resources: render/hydration.py). A completed download stands; one still
                # running or failed is replaced: deleted pods first (Foreground), so no old pod still
                # writes into the cache beside the new one; the pass after the Job has gone (its deletion
                # event) creates the new one. Files already there are kept.
                if not current.job.complete and not current.deleting:
                    await self._api.delete(
                        current.api_version,
                        "Job",
                        namespace,
                        current.name,
                        current.uid,
                        propagation="Foreground",
                    )
                    writes.applied.pop(child_key, None)
                continue
            result = await self._api.apply(manifest)
            metrics.CHILD_APPLIES.labels(kind=manifest["kind"]).inc()
            writes.applied[child_key] = (result.get("metadata") or {}).get("resourceVersion", "")
            if manifest["kind"] in UNWATCHED_KINDS:
                writes.unwatched[child_key] = child_state(result, uid)
            applied[manifest["kind"]] = result
        for child in observed.values():
            await self._api.delete(child.api_version, child.kind, namespace, child.name, child.uid)
            writes.applied.pop((child.kind, child.name), None)
            writes.unwatched[child.kind, child.name] = None
        return applied

    async def _existing(self, manifest: Mapping[str, Any], namespace: str, target: str) -> ChildState | None:
        """A child the indexes do not show (yet): absent, ours (a watch lagging, or left by an earlier
        target of this name, which the apply re-owns), or someone else's (NameConflict: never taken)."""
        kind, child = manifest["kind"], manifest["metadata"]["name"]
        body = await self._api.get(manifest["apiVersion"], kind, namespace, child)
        if body is None:
            return None
        owner = controlling_target(body.get("metadata") or {})
        if owner is None or owner[0] != target:
            refs = [f"{r.get('kind')}/{r.get('name')}" for r in body["metadata"].get("ownerReferences") or []]
            held = f"owned by {', '.join(refs)}" if refs else "not owned by any Eagle3Target"
            raise NameConflict(
                f"{kind} {namespace}/{child} already exists and is {held}; this target never takes it over:"
                " delete or rename that object, or give the target another name"
            )
        return child_state(body, owner[1])

    async def _look_up_unwatched(self, namespace: str, target: str, uid: str, writes: ChildWrites) -> None:
        """Once per process, find this target's PodMonitor by its name (no index shows PodMonitors), so one
        left by an earlier operator process is updated or deleted, not orphaned."""
        child_key = ("PodMonitor", child_name(target))
        if child_key in writes.unwatched:
            return
        manifest = {
            "apiVersion": POD_MONITOR_API_VERSION,
            "kind": "PodMonitor",
            "metadata": {"name": child_key[1]},
        }
        try:
            state = await self._existing(manifest, namespace, target)
        except NameConflict:
            state = None  # someone else's: left alone (and reported if the spec asks for a PodMonitor)
        writes.unwatched[child_key] = state if state is None or state.owner_uid == uid else None


def _rerendered(manifest: Mapping[str, Any], current: ChildState) -> bool:
    """Whether the rendering moved since the child was applied (its stamped digest)."""
    return rendered_digest(current.essence) != rendered_digest(manifest)


def _differs(manifest: Mapping[str, Any], current: ChildState, writes: ChildWrites) -> bool:
    """Whether to apply: the rendering moved (its digest), or someone else changed the child (drift)."""
    if _rerendered(manifest, current):
        return True
    child_key = (manifest["kind"], manifest["metadata"]["name"])
    if writes.applied.get(child_key) == current.resource_version:
        return False  # exactly what this process's last apply left
    return not matches(essence(manifest), current.essence)
