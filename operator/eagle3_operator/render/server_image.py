"""Which server image a target runs when its spec names none.

A target keeps the image it was first rendered with, so upgrading the operator restarts no target; only an
upgrade request annotated on the target moves it to the operator's current image.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

from eagle3_operator.constants import ANNOTATION_SERVER_IMAGE, ANNOTATION_UPGRADE, SERVER_CONTAINER

# The server image new targets that name no image get: the release matching this operator (the operator's
# --server-image overrides it, e.g. for a registry mirror).
DEFAULT_IMAGE = f"ghcr.io/eagle3-dev/eagle3-target:{version('eagle3-target')}"


@dataclass(frozen=True)
class ImagePin:
    """The server image a target runs when spec.image is unset, and the upgrade request that chose it."""

    image: str = DEFAULT_IMAGE
    upgrade: str | None = None


def pin_image(deployment: Mapping[str, Any] | None, upgrade: str | None, operator_image: str) -> ImagePin:
    """Which server image a target keeps: the one its Deployment was rendered with, unless the target asks
    for an upgrade the Deployment has not seen (then the operator's image). `deployment` is the stored one
    (its metadata and spec at least), None when there is none yet."""
    if deployment is None:
        return ImagePin(operator_image, upgrade)
    annotations = (deployment.get("metadata") or {}).get("annotations") or {}
    if annotations.get(ANNOTATION_UPGRADE) != upgrade:
        return ImagePin(operator_image, upgrade)
    pinned = annotations.get(ANNOTATION_SERVER_IMAGE)
    if pinned is None:  # rendered before images were pinned: keep the server image it runs
        containers = ((deployment.get("spec") or {}).get("template") or {}).get("spec", {}).get("containers")
        pinned = next((c.get("image") for c in containers or [] if c.get("name") == SERVER_CONTAINER), None)
    return ImagePin(pinned or operator_image, upgrade)
