"""The README and docs/ are what users read first: their commands, links and names must hold."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


def page(name: str) -> str:
    return (DOCS / name).read_text()


def test_the_two_local_commands_exist_in_the_makefile():
    local = README.split("\n## Try it on your machine\n", 1)[1]
    first_block = local.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make demo", "make test"]
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_relative_links_point_at_files():
    for path in PAGES:
        for target in re.findall(r"\]\(([^)#]+)\)", path.read_text()):
            if "://" not in target:
                assert (path.parent / target).exists(), f"{path.name}: {target}"


def test_resource_reference_matches_the_crd():
    generated = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "crd_reference.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "`spec.model.source.pvc.claimName`" in generated
    stale = "docs/reference.md is stale: run python scripts/crd_reference.py --write docs/reference.md"
    assert generated.strip() in page("reference.md"), stale


def test_the_layout_table_names_paths_that_exist():
    table = page("development.md").split("| piece | where |", 1)[1].split("\n\n", 1)[0]
    where = " ".join(row.split("|")[2] for row in table.strip().splitlines()[1:])
    paths = [path for path in re.findall(r"`([^`\s]+)`", where) if "/" in path]
    assert len(paths) >= 10, paths
    for path in paths:
        assert (REPO / path).exists(), path
    folders = {path.split("/")[0] for path in paths}
    tops = {"image", "operator", "crds", "charts", "examples", "bench", "scripts", "support", "tests"}
    assert tops <= folders


def test_every_format_is_described():
    from eagle3_target.protocol import FORMATS

    paragraph = page("server.md").split("Formats (", 1)[1].split("\n\n", 1)[0]
    described = set(re.findall(r"`(\w+)` \(", paragraph))
    assert described == set(FORMATS)


def test_every_metric_is_listed():
    from eagle3_operator import metrics as operator_metrics
    from eagle3_target.server.metrics import ServerMetrics
    from prometheus_client.metrics import MetricWrapperBase

    families = [family.name for family in ServerMetrics().registry.collect()]
    for value in vars(operator_metrics).values():
        if isinstance(value, MetricWrapperBase):
            families += [family.name for family in value.describe()]
    listed = page("monitoring.md")
    missing = [name for name in families if not re.search(rf"`{name}(_total|_info)?[{{`]", listed)]
    assert len(families) >= 15 and not missing, missing
