"""Which server image a target without spec.image runs: its engine's variant of the operator's images, kept
across operator upgrades, moved by an upgrade request or by an engine of another variant."""

from eagle3_operator.render.deployment import build_deployment
from eagle3_operator.render.server_image import DEFAULT_IMAGE, ServerImages, pin_image, release_image

from support.rendering import make_spec

OWNER = {"apiVersion": "eagle3.dev/v1alpha1", "kind": "Eagle3Target", "name": "t", "uid": "u1"}
OLD = ServerImages(default="mirror/e3t:1.0", sglang="mirror/e3t:1.0-sglang")
NEW = ServerImages(default="mirror/e3t:2.0", sglang="mirror/e3t:2.0-sglang")


def rendered(
    engine: str, images: ServerImages, stored: dict | None = None, upgrade: str | None = None
) -> dict:
    """The Deployment a pass renders for a target of `engine`, given the one stored (None: a new target)."""
    spec = make_spec(engine=engine, tensorParallelSize=1)
    return build_deployment("t", "ns", spec, OWNER, pin_image(stored, upgrade, images, engine))


def image_of(deployment: dict) -> str:
    return deployment["spec"]["template"]["spec"]["containers"][0]["image"]


def test_the_release_images_are_the_default_and_its_sglang_variant():
    assert ServerImages() == ServerImages(DEFAULT_IMAGE, release_image("sglang"))
    assert release_image("sglang") == f"{DEFAULT_IMAGE}-sglang"


def test_each_engine_gets_its_variant_and_keeps_it_across_operator_upgrades():
    vllm, sglang = rendered("vllm", OLD), rendered("sglang", OLD)
    assert image_of(vllm) == "mirror/e3t:1.0" and image_of(sglang) == "mirror/e3t:1.0-sglang"
    assert image_of(rendered("hf", OLD)) == "mirror/e3t:1.0"  # the default image serves hf too
    # The default variant's Deployment carries no variant annotation: one rendered before variants existed
    # reads the same, so upgrading the operator re-renders no target.
    assert "eagle3.dev/server-image-variant" not in vllm["metadata"]["annotations"]
    assert sglang["metadata"]["annotations"]["eagle3.dev/server-image-variant"] == "sglang"
    assert rendered("vllm", NEW, stored=vllm) == vllm
    assert rendered("sglang", NEW, stored=sglang) == sglang


def test_an_upgrade_request_moves_to_the_operators_current_image_of_the_variant():
    stored = rendered("sglang", OLD)
    assert image_of(rendered("sglang", NEW, stored=stored, upgrade="1")) == "mirror/e3t:2.0-sglang"


def test_moving_to_an_engine_of_another_variant_moves_to_that_variants_image():
    vllm = rendered("vllm", OLD)
    to_sglang = rendered("sglang", NEW, stored=vllm)
    assert image_of(to_sglang) == "mirror/e3t:2.0-sglang"
    back = rendered("vllm", NEW, stored=to_sglang)
    assert image_of(back) == "mirror/e3t:2.0"
    assert image_of(rendered("hf", NEW, stored=vllm)) == "mirror/e3t:1.0"  # same variant: kept
