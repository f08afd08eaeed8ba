"""kopf wiring: index the targets, their children and their pods; turn every change into a reconcile request.

Why event handlers and not on.create/on.update/on.resume: the reconcile is level-based (it renders and
compares everything each pass), so it only needs to know *that* something changed. Event handlers see
creation, every update and, at startup, every existing object (resume), and kopf stores nothing for them:
no `last-handled-configuration` annotation, no progress annotations, no finalizer. Deleting a target
therefore never waits for the operator; owner references let Kubernetes collect the children. Probing
runs in the reconciler's own asyncio tasks, not kopf timers, for the same reason (timers add a finalizer).

kopf delivers events only after every index is fully listed, so a pass never sees a half-built view.
With leader election every replica runs kopf, so a standby's indexes are as warm as the leader's; its
passes only queue until it wins the Lease (`memo.leading`), and then start at once.
"""

import asyncio
import copy
from dataclasses import dataclass
from typing import Any

import kopf
from eagle3_target.protocol import GROUP, PLURAL, VERSION, wake_annotation

from eagle3_operator.constants import (
    ANNOTATION_UPGRADE,
    LABEL_INSTANCE,
    MANAGED_LABELS,
    POD_SELECTOR,
    WATCHED_CHILD_KINDS,
)
from eagle3_operator.indexes import TargetKey, TargetSnapshot, child_state, controlling_target
from eagle3_operator.kube import KubeApi
from eagle3_operator.reconciler import Reconciler
from eagle3_operator.settings import OperatorConfig, configure
from eagle3_operator.status.observe import pod_view

# The operator's own registry (not kopf's global one), so importing this module has no side effects elsewhere.
registry = kopf.OperatorRegistry()


@dataclass
class Runtime:
    """What the handlers share, kept in kopf's memo."""

    api: KubeApi
    reconciler: Reconciler
    standby: asyncio.Task[None] | None = None  # a standby's wait for the Lease, which starts the passes


@kopf.on.login(registry=registry)
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In a pod: its ServiceAccount; elsewhere: the kubeconfig (exec plugins too, via the client library).

    The only sync handler: it runs once, in a thread, and the client library's loading is blocking.
    """
    return kopf.login_via_client(**kwargs)


@kopf.on.startup(registry=registry)
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> None:
    """Configure kopf and build the reconciler over the indexes (kopf passes them by handler id); start it
    now, or when `memo.leading` is set (leader election)."""
    config: OperatorConfig = getattr(memo, "config", None) or OperatorConfig()
    leading: asyncio.Event | None = getattr(memo, "leading", None)
    configure(settings, config)
    api = await KubeApi.connect(config.api_timeout_seconds)
    reconciler = Reconciler(
        api,
        targets=kwargs["target_index"],
        children=[kwargs[f"{child.plural}_index"] for child in WATCHED_CHILD_KINDS],
        pods=kwargs["pod_index"],
        neighbours=config.neighbours,
        probe_interval=config.reprobe_seconds,
        server_images=config.server_images,
    )
    memo.runtime = Runtime(api, reconciler)
    if leading is None:
        reconciler.start()
    else:
        memo.runtime.standby = asyncio.create_task(_start_when(leading, reconciler), name="standby")


async def _start_when(leading: asyncio.Event, reconciler: Reconciler) -> None:
    await leading.wait()
    reconciler.start()


@kopf.on.cleanup(registry=registry)
async def stop(memo: kopf.Memo, **_: Any) -> None:
    runtime: Runtime = memo.runtime
    if runtime.standby is not None:
        runtime.standby.cancel()
    await runtime.reconciler.close()
    await runtime.api.close()


@kopf.on.probe(id="targets", registry=registry)
async def known_targets(memo: kopf.Memo, **_: Any) -> int:
    """Liveness detail: how many targets this operator tracks."""
    return memo.runtime.reconciler.known_targets


def _key(namespace: str | None, name: str) -> TargetKey:
    """Targets, their children and pods are namespaced, so kopf always passes a namespace for them."""
    assert namespace is not None
    return namespace, name


@kopf.on.probe(id="probed_endpoints", registry=registry)
async def probed_endpoints(memo: kopf.Memo, **_: Any) -> int:
    """Liveness detail: how many target-server endpoints are being probed."""
    return memo.runtime.reconciler.probed_endpoints


@kopf.index(GROUP, VERSION, PLURAL, registry=registry)
async def target_index(
    namespace: str | None, name: str, meta: kopf.Meta, body: kopf.Body, **_: Any
) -> dict[TargetKey, Any]:
    snapshot = TargetSnapshot(
        uid=meta["uid"],
        generation=meta.get("generation", 0),
        resource_version=meta.get("resourceVersion", ""),
        spec=copy.deepcopy(dict(body.get("spec") or {})),
        status=copy.deepcopy(dict(body.get("status") or {})),
        deleting=meta.get("deletionTimestamp") is not None,
        upgrade=(meta.get("annotations") or {}).get(ANNOTATION_UPGRADE),
        wake=wake_annotation(meta),
    )
    return {_key(namespace, name): snapshot}


@kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
async def target_changed(
    namespace: str | None, name: str, meta: kopf.Meta, memo: kopf.Memo, **_: Any
) -> None:
    reconciler: Reconciler = memo.runtime.reconciler
    key = _key(namespace, name)
    if not reconciler.is_own_write(key, meta.get("resourceVersion", ""), meta.get("generation", 0)):
        reconciler.request(key)


@kopf.index(*POD_SELECTOR, labels=MANAGED_LABELS, registry=registry)
async def pod_index(
    namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[TargetKey, Any]:
    """Live pods by their target's instance label; a finished server pod (Failed, Succeeded) leaves it."""
    instance = labels.get(LABEL_INSTANCE)
    view = pod_view(body) if instance else None
    return {_key(namespace, instance): view} if instance and view else {}


@kopf.on.event(*POD_SELECTOR, labels=MANAGED_LABELS, registry=registry)
async def pod_changed(namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    instance = labels.get(LABEL_INSTANCE)
    if instance:
        memo.runtime.reconciler.request_instance(*_key(namespace, instance))


async def child_index(
    namespace: str | None, meta: kopf.Meta, body: kopf.Body, **_: Any
) -> dict[TargetKey, Any]:
    """The index of one child kind (registered once per kind below): owned objects, by their target."""
    owner = controlling_target(meta)
    return {_key(namespace, owner[0]): child_state(dict(body), owner[1])} if owner else {}


async def child_changed(namespace: str | None, meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    owner = controlling_target(meta)
    if owner is not None:
        memo.runtime.reconciler.request(_key(namespace, owner[0]))


# The same index and change trigger for every child kind; kopf tells them apart by id.
for _child in WATCHED_CHILD_KINDS:
    kopf.index(*_child.selector, id=f"{_child.plural}_index", labels=MANAGED_LABELS, registry=registry)(
        child_index
    )
    kopf.on.event(*_child.selector, id=f"{_child.plural}_changed", labels=MANAGED_LABELS, registry=registry)(
        child_changed
    )
