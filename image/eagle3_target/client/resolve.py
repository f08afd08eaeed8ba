"""Find a served target by its `Eagle3Target` name: read status, wait until it serves, say where to connect.

By default a target is usable once it is Available: at least one endpoint serves the current generation's
model, so a job starts during a scale-up, a rollout that keeps the model, or while some replicas cannot be
scheduled, and gets the endpoints that serve. `require="Ready"` waits for every desired replica instead.
A status only counts once the operator has observed the current spec (status.observedGeneration and the
condition's observedGeneration both equal metadata.generation); otherwise a training job could start against
the previous model right after someone edited the resource.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Generator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, cast

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch
from kubernetes.client.rest import ApiException
from kubernetes.config.config_exception import ConfigException
from urllib3.exceptions import HTTPError as TransportError

from eagle3_target.client.errors import (
    ResolveError,
    ResolveTimeout,
    TargetAccessForbidden,
    TargetCRDMissing,
    TargetNotFound,
)
from eagle3_target.protocol import (
    ANNOTATION_WAKE_REQUESTED,
    GROUP,
    IDLE_SINCE,
    PLURAL,
    VERSION,
    ServedModel,
    wake_annotation,
    wake_requested,
)

IN_CLUSTER_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
# Used only when watching fails: forbidden (a role granting get but not watch) or a broken stream.
POLL_INTERVAL_S = 2.0
# The condition a resolve waits for: Available (some endpoint serves the current model) or Ready (all do).
Requirement = Literal["Available", "Ready"]


@dataclass(frozen=True)
class TargetResource:
    """Where the Eagle3Target API lives; a parameter so other (or absent) API versions can be addressed."""

    group: str = GROUP
    version: str = VERSION
    plural: str = PLURAL


EAGLE3_TARGET = TargetResource()


@dataclass(frozen=True)
class ResolvedTarget:
    """A serving target: its Service URL, the addresses of the pods serving its current model, that model."""

    name: str
    namespace: str
    generation: int
    url: str | None
    endpoints: tuple[str, ...]
    model: ServedModel | None = None  # status.model

    @property
    def fingerprint(self) -> str | None:
        return self.model.fingerprint if self.model else None

    @property
    def urls(self) -> tuple[str, ...]:
        """Where to send requests: the ready pods directly (client-side balancing), else the Service URL."""
        if self.endpoints:
            return self.endpoints
        return (self.url,) if self.url else ()

    def to_dict(self) -> dict[str, Any]:
        model = self.model.model_dump(mode="json") if self.model else None
        return asdict(self) | {"model": model, "fingerprint": self.fingerprint}


def api_client_from_environment(kubeconfig: str | None = None) -> tuple[k8s.ApiClient, str]:
    """A client and its default namespace: given kubeconfig, else in-cluster, else the default kubeconfig."""
    configuration = k8s.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)
            return k8s.ApiClient(configuration), IN_CLUSTER_NAMESPACE_FILE.read_text().strip()
        except (ConfigException, OSError):
            pass  # Not actually a pod (or no service account mounted): use a kubeconfig.
    try:
        k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        _, active = k8s_config.list_kube_config_contexts(config_file=kubeconfig)
    except (ConfigException, OSError) as exc:
        raise ResolveError(
            f"no Kubernetes credentials: not in a pod and no usable kubeconfig ({exc})"
        ) from exc
    namespace = (active or {}).get("context", {}).get("namespace") or "default"
    return k8s.ApiClient(configuration), namespace


def find_condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), None)


def readiness(obj: dict[str, Any], require: Requirement = "Available") -> tuple[bool, str]:
    """Whether a snapshot of the resource meets `require` for its current generation, and if not, why.

    An operator too old to publish Available is held to Ready.
    """
    generation = obj.get("metadata", {}).get("generation")
    status = obj.get("status") or {}
    kind = require if require == "Ready" or find_condition(status, require) else "Ready"
    ready = find_condition(status, kind)
    if ready is None:
        return False, f"no {kind} condition yet (phase {status.get('phase')!r})"
    state = f"{kind}={ready.get('status')} reason={ready.get('reason')!r} message={ready.get('message')!r}"
    if status.get("observedGeneration") != generation:
        return False, (
            f"status is stale: status.observedGeneration={status.get('observedGeneration')} but "
            f"metadata.generation={generation} (last {state})"
        )
    if ready.get("observedGeneration") != generation:
        return False, (
            f"{kind} condition is stale: its observedGeneration={ready.get('observedGeneration')} but "
            f"metadata.generation={generation} (last {state})"
        )
    if idle(obj):
        # Set before the scale-down starts: the endpoints still listed are going away.
        return False, f"idle since {status['idle'].get(IDLE_SINCE)} ({state})"
    if ready.get("status") != "True":
        return False, state
    if not (ready_endpoints(status) or status.get("url")):
        return False, f"{kind} but neither status.url nor a ready endpoint is published"
    return True, state


def idle(obj: dict[str, Any]) -> bool:
    """Whether the operator has scaled the target to zero for idleness, or is doing so (it then waits for a
    wake)."""
    return bool((obj.get("status") or {}).get("idle"))


def request_wake(api: k8s.CustomObjectsApi, resource: TargetResource, obj: dict[str, Any]) -> None:
    """Ask the operator to wake an idle target, once per wake whoever asks: a new value of its wake
    annotation (the time, to the microsecond), written only while the annotation still has the value
    status.idle recorded, and only onto the version read (a conflict means someone else wrote meanwhile: the
    next read shows whether the wake is asked for)."""
    meta = obj["metadata"]
    if wake_requested(wake_annotation(meta), obj["status"]["idle"]):
        return
    patch = {
        "metadata": {
            "resourceVersion": meta["resourceVersion"],
            "annotations": {ANNOTATION_WAKE_REQUESTED: datetime.now(UTC).isoformat()},
        }
    }
    try:
        api.patch_namespaced_custom_object(
            resource.group, resource.version, meta["namespace"], resource.plural, meta["name"], patch
        )
    except ApiException as exc:
        if exc.status == 409:
            return
        if exc.status in (401, 403):
            raise TargetAccessForbidden(
                f"{resource.plural}/{meta['name']} in namespace {meta['namespace']!r} is idle and waking it "
                f"needs `patch` on {resource.plural}.{resource.group} (Kubernetes' edit role has it where "
                f"the eagle3-operator chart is installed): HTTP {exc.status} {_api_message(exc)}; or resolve "
                "with wake=False (--no-wake) and ask someone who may to wake it"
            ) from exc
        raise _classify(api, resource, meta["name"], meta["namespace"], exc) from exc


def ready_endpoints(status: dict[str, Any]) -> tuple[str, ...]:
    endpoints = status.get("endpoints") or []
    return tuple(e["address"] for e in endpoints if e.get("ready") and e.get("address"))


def resolved_from(obj: dict[str, Any]) -> ResolvedTarget:
    status = obj.get("status") or {}
    return ResolvedTarget(
        name=obj["metadata"]["name"],
        namespace=obj["metadata"]["namespace"],
        generation=obj["metadata"].get("generation", 0),
        url=status.get("url"),
        endpoints=ready_endpoints(status),
        model=served_model(status["model"]) if status.get("model") else None,
    )


def served_model(model: dict[str, Any]) -> ServedModel:
    """status.model with its capture set filled in: a status from before capture sets has none, and the
    servers then captured the aux layers alone."""
    served = ServedModel.model_validate(model)
    if served.capture_layer_ids is None:
        return served.model_copy(update={"capture_layer_ids": served.aux_layer_ids})
    return served


def resolve(
    name: str,
    namespace: str | None = None,
    wait: float = 300.0,
    *,
    kubeconfig: str | None = None,
    api_client: k8s.ApiClient | None = None,
    resource: TargetResource = EAGLE3_TARGET,
    require: Requirement = "Available",
    wake: bool = True,
) -> ResolvedTarget:
    """Return target `name` and the endpoints serving it, waiting up to `wait` seconds (0: check once) until
    it is Available (default: some endpoint serves the current model) or, with require="Ready", every
    desired replica serves. An idle target is woken first unless `wake` is False. (`eagle3-target resolve`
    checks once unless given `--wait`.)

    Raises TargetNotFound, TargetCRDMissing, TargetAccessForbidden (also when waking is not allowed) or
    ResolveTimeout (naming the last reason).
    """
    if api_client is None:
        api_client, default_namespace = api_client_from_environment(kubeconfig)
    else:
        default_namespace = "default"
    namespace = namespace or default_namespace
    api = k8s.CustomObjectsApi(api_client)
    deadline = time.monotonic() + max(wait, 0.0)
    woken = False
    why = "not read yet"
    with contextlib.closing(_snapshots(api, resource, name, namespace, deadline)) as snapshots:
        for obj in snapshots:
            ready, why = readiness(obj, require)
            if ready:
                return resolved_from(obj)
            if wake and idle(obj):  # on every snapshot: a target may idle while it is awaited
                request_wake(api, resource, obj)
                woken = True
            if woken:
                why = f"{why}; woken from idle, waiting for scheduling and a model load"
    raise ResolveTimeout(f"{resource.plural}/{name} in {namespace} not {require} after {wait:g}s: {why}")


def follow_resource(
    name: str, namespace: str | None, wait: float, kubeconfig: str | None
) -> tuple[ResolvedTarget, Callable[[float], ResolvedTarget]]:
    """Resolve the target now, and a function that resolves it again, waiting up to the seconds it is given
    (0: read it once) to pick up endpoint changes or a target that serves again."""
    api_client, default_namespace = api_client_from_environment(kubeconfig)
    namespace = namespace or default_namespace
    resolved = resolve(name, namespace, wait, api_client=api_client)

    def refresh(wait: float) -> ResolvedTarget:
        return resolve(name, namespace, wait, api_client=api_client)

    return resolved, refresh


def _get(api: k8s.CustomObjectsApi, resource: TargetResource, name: str, namespace: str) -> dict[str, Any]:
    try:
        # The API answers with the object's JSON; the client types it as `object`.
        return cast(
            dict[str, Any],
            api.get_namespaced_custom_object(
                resource.group, resource.version, namespace, resource.plural, name
            ),
        )
    except ApiException as exc:
        raise _classify(api, resource, name, namespace, exc) from exc
    except TransportError as exc:
        raise ResolveError(
            f"cannot reach the Kubernetes API server to read {resource.plural}/{name}: {exc}"
        ) from exc


def _classify(
    api: k8s.CustomObjectsApi, resource: TargetResource, name: str, namespace: str, exc: ApiException
) -> ResolveError:
    """Turn an API error into the class a caller acts on (create the target, install the CRD, fix RBAC)."""
    if exc.status in (401, 403):
        return TargetAccessForbidden(
            f"not allowed to read {resource.plural}.{resource.group}/{name} in namespace {namespace!r}: "
            f"HTTP {exc.status} {_api_message(exc)}"
        )
    if exc.status == 404:
        if not _api_served(api, resource):
            return TargetCRDMissing(
                f"the cluster does not serve {resource.plural}.{resource.group}/{resource.version}: "
                "is the Eagle3Target CRD installed?"
            )
        return TargetNotFound(
            f"{resource.plural}.{resource.group} {name!r} not found in namespace {namespace!r}"
        )
    return ResolveError(
        f"reading {resource.plural}/{name} in {namespace!r} failed: HTTP {exc.status} {exc.reason}"
    )


def _api_served(api: k8s.CustomObjectsApi, resource: TargetResource) -> bool:
    try:
        served = api.get_api_resources(resource.group, resource.version)
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return any(r.name == resource.plural for r in served.resources)


def _api_message(exc: ApiException) -> str:
    try:
        return json.loads(exc.body or "").get("message", exc.reason)
    except (TypeError, ValueError):
        return str(exc.reason)


def _snapshots(
    api: k8s.CustomObjectsApi, resource: TargetResource, name: str, namespace: str, deadline: float
) -> Generator[dict[str, Any], None, None]:
    """The object as it changes until `deadline`: read once, then watched from that version (read again
    when a watch ends or its version expired), or read every POLL_INTERVAL_S where watching fails."""
    watch_allowed = True
    while True:
        obj = _get(api, resource, name, namespace)
        yield obj
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        if watch_allowed:
            watch_allowed = yield from _watch(api, resource, obj, remaining)
        else:
            time.sleep(min(POLL_INTERVAL_S, remaining))


def _watch(
    api: k8s.CustomObjectsApi, resource: TargetResource, obj: dict[str, Any], remaining: float
) -> Generator[dict[str, Any], None, bool]:
    """The object's versions after the snapshot's, for up to `remaining` seconds; returns whether watching
    works (forbidden, as with a role granting get but not watch, or a broken stream: poll instead)."""
    meta = obj["metadata"]
    watcher = k8s_watch.Watch()
    try:
        for event in watcher.stream(
            api.list_namespaced_custom_object,
            resource.group,
            resource.version,
            meta["namespace"],
            resource.plural,
            field_selector=f"metadata.name={meta['name']}",
            resource_version=meta.get("resourceVersion"),
            timeout_seconds=max(1, int(remaining)),
            _request_timeout=remaining + 5,
        ):
            kind, current = event["type"], event["object"]
            if kind == "DELETED":
                raise TargetNotFound(f"{resource.plural} {meta['name']!r} was deleted while waiting for it")
            if kind in ("ADDED", "MODIFIED"):
                yield current
            if kind == "ERROR":
                break  # e.g. the resourceVersion expired: re-read and watch again.
    except ApiException as exc:
        if exc.status == 403:
            return False
        if exc.status != 410:
            raise _classify(api, resource, meta["name"], meta["namespace"], exc) from exc
    except TransportError:
        return False  # The watch stream broke (API server restart, a proxy): poll from now on.
    finally:
        watcher.stop()
    return True
