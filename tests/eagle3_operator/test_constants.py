"""The child-kind table covers exactly what the renderer builds, and every child carries the watched label."""

from eagle3_operator.constants import CHILD_KINDS, MANAGED_LABELS, WATCHED_CHILD_KINDS
from eagle3_operator.kube import object_path
from eagle3_operator.render.children import build_children
from eagle3_operator.spec import Eagle3TargetSpec

from support.rendering import UID


def test_the_table_lists_every_rendered_kind_once():
    spec = Eagle3TargetSpec.parse(
        {
            "model": {"name": "tiny", "source": {"huggingFace": {"repo": "org/tiny", "cacheClaimName": "c"}}},
            "replicas": 2,
            "monitoring": {"podMonitor": {"enabled": True}},
            "networkPolicy": {"enabled": True},
        }
    )
    rendered = build_children("tiny", "ml", UID, spec, pod_monitor_supported=True)
    table = {(child.api_version, child.kind) for child in CHILD_KINDS}
    assert {(child["apiVersion"], child["kind"]) for child in rendered} == table
    assert len(table) == len(CHILD_KINDS)
    plurals = {child.kind: child.plural for child in CHILD_KINDS}
    for child in rendered:
        assert MANAGED_LABELS.items() <= child["metadata"]["labels"].items()
        name = child["metadata"]["name"]
        path = object_path(child["apiVersion"], child["kind"], "ml", name)
        assert path.endswith(f"/namespaces/ml/{plurals[child['kind']]}/{name}")


def test_kopf_selectors_name_group_version_and_plural():
    assert {child.selector for child in WATCHED_CHILD_KINDS} == {
        ("apps", "v1", "deployments"),
        ("v1", "services"),
        ("policy", "v1", "poddisruptionbudgets"),
        ("networking.k8s.io", "v1", "networkpolicies"),
        ("batch", "v1", "jobs"),
    }
