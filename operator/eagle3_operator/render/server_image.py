"""Which server image a target runs when its spec names none.

The release comes in variants, one per set of engines installed (the default image, on vLLM's, serves vllm
and hf; `-sglang`, on SGLang's, serves sglang): a target gets the operator's image of its engine's variant.
A target keeps the image it was first rendered with, so upgrading the operator restarts no target; only an
upgrade request annotated on the target, or moving to an engine of another variant, moves it to the
operator's current image.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

from eagle3_target.engines import ENGINES

from eagle3_operator.constants import (
    ANNOTATION_SERVER_IMAGE,
    ANNOTATION_SERVER_IMAGE_VARIANT,
    ANNOTATION_UPGRADE,
    SERVER_CONTAINER,
)

# The server image new targets that name no image get: the release matching this operator (the operator's
# --server-image overrides it, e.g. for a registry mirror), and its variants (--sglang-server-image).
DEFAULT_IMAGE = f"ghcr.io/eagle3-dev/eagle3-target:{version('eagle3-target')}"


def release_image(variant: str) -> str:
    """The release's image of a variant ("" is the default image)."""
    return f"{DEFAULT_IMAGE}-{variant}" if variant else DEFAULT_IMAGE


@dataclass(frozen=True)
class ServerImages:
    """The operator's server image of each variant, for targets without spec.image."""

    default: str = DEFAULT_IMAGE
    sglang: str = release_image("sglang")

    def for_engine(self, engine: str) -> tuple[str, str]:
        """The image for a target of this engine, and its variant."""
        variant = ENGINES[engine].image_variant
        return (self.sglang if variant == "sglang" else self.default), variant


DEFAULT_IMAGES = ServerImages()


@dataclass(frozen=True)
class ImagePin:
    """The server image a target runs when spec.image is unset, its variant, and the upgrade request that
    chose it."""

    image: str = DEFAULT_IMAGE
    upgrade: str | None = None
    variant: str = ""


def pin_image(
    deployment: Mapping[str, Any] | None, upgrade: str | None, images: ServerImages, engine: str
) -> ImagePin:
    """Which server image a target keeps: the one its Deployment was rendered with, unless the target asks
    for an upgrade the Deployment has not seen, or its engine needs another variant (then the operator's
    image of that variant). `deployment` is the stored one (its metadata and spec at least), None when
    there is none yet."""
    operator_image, variant = images.for_engine(engine)
    if deployment is None:
        return ImagePin(operator_image, upgrade, variant)
    annotations = (deployment.get("metadata") or {}).get("annotations") or {}
    if annotations.get(ANNOTATION_UPGRADE) != upgrade:
        return ImagePin(operator_image, upgrade, variant)
    if annotations.get(ANNOTATION_SERVER_IMAGE_VARIANT, "") != variant:
        return ImagePin(operator_image, upgrade, variant)
    pinned = annotations.get(ANNOTATION_SERVER_IMAGE)
    if pinned is None:  # rendered before images were pinned: keep the server image it runs
        containers = ((deployment.get("spec") or {}).get("template") or {}).get("spec", {}).get("containers")
        pinned = next((c.get("image") for c in containers or [] if c.get("name") == SERVER_CONTAINER), None)
    return ImagePin(pinned or operator_image, upgrade, variant)
