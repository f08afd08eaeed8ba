"""Every Kubernetes API call the operator makes (reads come from kopf's watches, not from here).

Children are written with server-side apply under one field manager, so applying the full desired object
is idempotent and takes back any field someone else changed. The status is written with a JSON merge patch
of only the keys that changed. All calls are async (kubernetes' aiohttp client), bounded by a timeout, and
counted in the operator's metrics.
"""

import json
import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import quote

import aiohttp
from eagle3_target.protocol import API_VERSION, FIELD_MANAGER, GROUP, KIND, PLURAL
from kubernetes.aio import client as aio_client
from kubernetes.aio import config as aio_config

from eagle3_operator import metrics
from eagle3_operator.constants import ANNOTATION_SCHEMA_VERSION, CHILD_KINDS
from eagle3_operator.settings import OperatorConfig
from eagle3_operator.status.observation import timestamp

LEASES = "coordination.k8s.io/v1"
DISCOVERY_TTL_SECONDS = 300.0

# The kinds the operator owns, by (apiVersion, kind) → plural.
CHILD_PLURALS = {(child.api_version, child.kind): child.plural for child in CHILD_KINDS}


class KubeError(Exception):
    """An API call answered with an error status (or not at all: status 0)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class NameConflict(Exception):
    """A child's name is taken by an object this target does not own: it is never taken over."""


@dataclass(frozen=True)
class TargetRef:
    namespace: str
    name: str
    uid: str


def collection_path(api_version: str, plural: str, namespace: str) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{quote(namespace)}/{plural}"


def object_path(api_version: str, kind: str, namespace: str, name: str) -> str:
    return f"{collection_path(api_version, CHILD_PLURALS[api_version, kind], namespace)}/{quote(name)}"


class KubeApi:
    def __init__(
        self, api_client: aio_client.ApiClient, timeout: float = OperatorConfig.api_timeout_seconds
    ) -> None:
        self._api = api_client
        self._timeout = timeout
        self._discovered: dict[str, tuple[float, bool]] = {}  # group/version -> (when asked, served)

    @classmethod
    async def connect(cls, timeout: float = OperatorConfig.api_timeout_seconds) -> "KubeApi":
        """In a pod: its ServiceAccount. Elsewhere: $KUBECONFIG (or ~/.kube/config)."""
        configuration = aio_client.Configuration()
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            aio_config.load_incluster_config(client_configuration=configuration)
        else:
            await aio_config.load_kube_config(
                config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration
            )
        return cls(aio_client.ApiClient(configuration), timeout)

    async def close(self) -> None:
        await self._api.close()

    async def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply of a whole child; force, because the operator is the only owner of its fields."""
        metadata = manifest["metadata"]
        path = object_path(manifest["apiVersion"], manifest["kind"], metadata["namespace"], metadata["name"])
        query = [("fieldManager", FIELD_MANAGER), ("force", "true")]
        return await self._request("PATCH", path, query, manifest, "application/apply-patch+yaml")

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """One child-kind object by name, or None when there is none."""
        try:
            return await self._request("GET", object_path(api_version, kind, namespace, name))
        except KubeError as error:
            if error.status == 404:
                return None
            raise

    async def delete(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        uid: str,
        *,
        propagation: Literal["Background", "Foreground"] = "Background",
    ) -> None:
        """Delete one child, only if it is still the object observed (uid precondition); gone is fine.
        Its dependents go too (a Job's pods would otherwise be orphaned, its API's default): after it
        (Background), or before it (Foreground: the object stays, being deleted, until they are gone)."""
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "preconditions": {"uid": uid},
            "propagationPolicy": propagation,
        }
        try:
            await self._request("DELETE", object_path(api_version, kind, namespace, name), [], body)
        except KubeError as error:
            if error.status not in (404, 409):
                raise

    async def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        path = f"{collection_path(API_VERSION, PLURAL, namespace)}/{quote(name)}/status"
        query = [("fieldManager", FIELD_MANAGER)]
        return await self._request("PATCH", path, query, {"status": patch}, "application/merge-patch+json")

    async def post_event(self, target: TargetRef, type_: str, reason: str, message: str) -> None:
        """A core/v1 Event on the target (what `kubectl describe e3t` shows)."""
        now = timestamp(datetime.now(UTC))
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{target.name}.", "namespace": target.namespace},
            "involvedObject": {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": target.name,
                "namespace": target.namespace,
                "uid": target.uid,
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": FIELD_MANAGER},
            "reportingComponent": FIELD_MANAGER,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        await self._request("POST", collection_path("v1", "events", target.namespace), [], event)

    async def crd_schema_version(self) -> int | None:
        """The installed Eagle3Target CRD's constants.ANNOTATION_SCHEMA_VERSION (0 when it has none), or None
        when the CRD is not installed."""
        path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{PLURAL}.{GROUP}"
        try:
            crd = await self._request("GET", path)
        except KubeError as error:
            if error.status == 404:
                return None
            raise
        annotations = (crd.get("metadata") or {}).get("annotations") or {}
        value = annotations.get(ANNOTATION_SCHEMA_VERSION, "0")
        return int(value) if value.isdigit() else 0

    async def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._request("GET", f"{collection_path(LEASES, 'leases', namespace)}/{quote(name)}")
        except KubeError as error:
            if error.status == 404:
                return None
            raise

    async def write_lease(self, lease: dict[str, Any]) -> dict[str, Any]:
        """Create a Lease, or replace it under its resourceVersion (409 when someone else wrote it since)."""
        metadata = lease["metadata"]
        collection = collection_path(LEASES, "leases", metadata["namespace"])
        if metadata.get("resourceVersion"):
            return await self._request("PUT", f"{collection}/{quote(metadata['name'])}", [], lease)
        return await self._request("POST", collection, [], lease)

    async def serves(self, group_version: str, max_age: float = DISCOVERY_TTL_SECONDS) -> bool:
        """Whether the API server serves an API group version (e.g. monitoring.coreos.com/v1).

        Cached (asked on every pass), for at most `max_age` seconds: a CRD installed later is noticed.
        """
        cached = self._discovered.get(group_version)
        if cached is not None and time.monotonic() - cached[0] < max_age:
            return cached[1]
        try:
            await self._request("GET", f"/apis/{group_version}")
            served = True
        except KubeError as error:
            if error.status != 404:
                raise
            served = False
        self._discovered[group_version] = (time.monotonic(), served)
        return served

    async def _request(
        self,
        method: str,
        path: str,
        query: list[tuple[str, str]] | None = None,
        body: dict[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        metrics.API_REQUESTS.labels(method=method).inc()
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        try:
            prepared = await self._api.param_serialize(
                method,
                path,
                query_params=query or [],
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            response = await self._api.call_api(*prepared, _request_timeout=self._timeout)
            data = await response.read()
        except (aiohttp.ClientError, OSError, TimeoutError, aio_client.ApiException) as error:
            raise KubeError(0, f"{method} {path}: {type(error).__name__}: {error}") from error
        if response.status >= 400:
            raise KubeError(response.status, f"{method} {path}: {_reason(data)}")
        return json.loads(data) if data else {}


def _reason(data: bytes) -> str:
    try:
        return json.loads(data).get("message") or data.decode(errors="replace")
    except ValueError:
        return data.decode(errors="replace")[:500]
