"""kube-score (a linter nobody here wrote, built by support/cluster/build-tools.sh) on what we ship: the chart
rendered with each value set, and the children the operator renders for the examples and for a Hugging Face
source. Every finding left is one docs/development.md lists as deliberate, with its reason, and every
listed one still occurs (a fixed finding leaves the list)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import yaml
from eagle3_operator.render.children import build_children
from eagle3_operator.spec import Eagle3TargetSpec

from support.chart import VALUE_SETS, render
from support.cluster.access import BIN_DIR, REPO
from support.rendering import HF_SOURCE, UID

BEGIN = "<!-- kube-score findings: checked by tests/charts/test_kube_score.py -->"
END = "<!-- end of kube-score findings -->"
OK = 10  # kube-score's grade of a passed check


def deliberate() -> set[tuple[str, str, str]]:
    """(object, check id, finding) rows of docs/development.md's table."""
    text = (REPO / "docs" / "development.md").read_text()
    table = text[text.index(BEGIN) + len(BEGIN) : text.index(END)]
    rows = set()
    for line in table.splitlines():
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1] and not set(cells[1]) <= {"-"} and cells[1] != "Check":
            rows.add((cells[0], cells[1], cells[2]))
    assert rows, "docs/development.md lists no kube-score findings"
    return rows


def findings(objects: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """(object's role, check id, container and comment) of every failed or warned check."""
    documents = "---\n".join(yaml.safe_dump(o) for o in objects)
    result = subprocess.run(
        [str(BIN_DIR / "kube-score"), "score", "--output-format=json", "-"],
        input=documents,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode in (0, 1), result.stderr  # 1: some check failed
    found = set()
    for scored in json.loads(result.stdout):
        kind, name = scored["type_meta"]["kind"], scored["object_meta"]["name"]
        for check in scored["checks"]:
            if check["skipped"] or check["grade"] >= OK:
                continue
            for comment in check["comments"] or [{"summary": check["check"]["name"]}]:
                where = f"({comment['path']}) " if comment.get("path") else ""
                found.add((_role(kind, name), check["check"]["id"], where + comment["summary"]))
    return found


def example_targets() -> list[tuple[str, Eagle3TargetSpec]]:
    targets = []
    for path in sorted((REPO / "examples").rglob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document and document.get("kind") == "Eagle3Target":
                targets.append((document["metadata"]["name"], Eagle3TargetSpec.parse(document["spec"])))
    hub = {
        "model": {"name": "org/tiny-model", "source": HF_SOURCE},
        "resources": {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "32Gi"}},
    }
    return [*targets, ("from-the-hub", Eagle3TargetSpec.parse(hub))]


def test_only_the_readmes_deliberate_findings_remain():
    objects = [o for values in VALUE_SETS.values() for o in render(values)]
    objects = list(
        {(o["kind"], o["metadata"]["name"], json.dumps(o, sort_keys=True)): o for o in objects}.values()
    )
    for name, spec in example_targets():
        objects += build_children(name, "ml", UID, spec, pod_monitor_supported=True)
    assert findings(objects) == deliberate()


def _role(kind: str, name: str) -> str:
    """What docs/development.md calls an object: the chart's Deployment, any target's Deployment or Job."""
    if name == "e3-eagle3-operator":
        return f"chart {kind}"
    return {"Deployment": "target Deployment", "Job": "hydration Job"}.get(kind, f"target {kind}")
