"""Everything a target should own, each child stamped with the digest of its rendering.

The reconciler applies a child when its stamp differs from the rendering (so a field removed from the spec is
pruned by server-side apply) and deletes an owned kind missing from the list.
"""

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from eagle3_operator.constants import ANNOTATION_RENDERED_DIGEST
from eagle3_operator.render.deployment import build_deployment, build_pdb
from eagle3_operator.render.hydration import build_hydration_job
from eagle3_operator.render.names import owner_reference
from eagle3_operator.render.network import Neighbours, build_network_policy, build_pod_monitor, build_service
from eagle3_operator.render.server_image import ImagePin
from eagle3_operator.spec import Eagle3TargetSpec


def stamp_digest(manifest: dict[str, Any]) -> dict[str, Any]:
    """`manifest` with ANNOTATION_RENDERED_DIGEST set to the digest of everything else in it."""
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    metadata = manifest["metadata"]
    metadata["annotations"] = {**metadata.get("annotations", {}), ANNOTATION_RENDERED_DIGEST: digest}
    return manifest


def rendered_digest(child: Mapping[str, Any]) -> str | None:
    """The digest stamped on a child (rendered or as stored), if any."""
    return ((child.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_RENDERED_DIGEST)


def build_children(
    name: str,
    namespace: str,
    uid: str,
    spec: Eagle3TargetSpec,
    *,
    pod_monitor_supported: bool,
    neighbours: Neighbours = Neighbours(),
    hydrated: bool = True,
    idle: bool = False,
    pin: ImagePin = ImagePin(),
) -> list[dict[str, Any]]:
    """Everything the target should own now, each stamped with its digest; an owned kind missing from the
    list should be deleted.

    `hydrated`: whether a huggingFace source's hydration Job has completed (always true for other sources);
    `idle`: whether the target is scaled to zero for idleness (status.idle).
    """
    if spec.external:
        return []
    owner = owner_reference(name, uid)
    deployment = build_deployment(name, namespace, spec, owner, pin, hydrated=hydrated, idle=idle)
    children = [deployment, build_service(name, namespace, spec, owner)]
    optional = [
        build_hydration_job(name, namespace, spec, owner, pin),
        build_pdb(name, namespace, spec, owner),
        build_network_policy(name, namespace, spec, owner, neighbours),
    ]
    if pod_monitor_supported:
        optional.append(build_pod_monitor(name, namespace, spec, owner, neighbours))
    return [stamp_digest(child) for child in children + optional if child is not None]
