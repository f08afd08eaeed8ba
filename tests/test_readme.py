"""The README and docs/ are what users read first: every command, flag, field, metric, condition reason and
error class they name must exist in the code, and every link must lead somewhere."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
import typer
import yaml

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md")), REPO / "charts" / "eagle3-operator" / "README.md"]
# Pages for users: the project's own machine and test doubles are not theirs to read about.
USER_PAGES = [path for path in PAGES if path.name != "development.md"]
CRD = yaml.safe_load((REPO / "crds" / "eagle3targets.eagle3.dev.yaml").read_text())
MAX_README_LINES = 250
SEPARATORS = {"&&", "||", "|", ";", "exec", "sudo"}


def page(name: str) -> str:
    return (DOCS / name).read_text()


def code_lines(text: str) -> Iterator[str]:
    """Each command line of the fenced code blocks, continuation lines joined, comments dropped."""
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].strip()
            if line and not line.startswith("#"):
                yield line


def documented_lines() -> Iterator[tuple[str, str]]:
    for path in PAGES:
        text = path.read_text()
        for line in code_lines(text):
            yield path.name, line
        for inline in re.findall(r"`([^`\n]+)`", text):
            yield path.name, inline


def table_names(text: str, heading: str) -> set[str]:
    """The backticked names in the first column of the tables under `heading` (to the next heading)."""
    section = text.split(f"\n{heading}\n", 1)[1]
    section = re.split(r"\n#{1,3} ", section, maxsplit=1)[0]
    names = set()
    for row in section.splitlines():
        if row.startswith("|"):
            names |= set(re.findall(r"`([A-Za-z][A-Za-z0-9]*)`", row.split("|")[1]))
    return names


def test_the_readme_is_short_and_says_nothing_about_our_machine():
    assert len(README.splitlines()) <= MAX_README_LINES
    banned = r"this machine|2 cores|2-core|test kubelet|stand-in|stand_in|measured here|tested here"
    for path in USER_PAGES:
        found = re.findall(banned, path.read_text(), re.I)
        assert not found, f"{path.name}: {found}"


def test_the_two_local_commands_exist_in_the_makefile():
    local = README.split("\n## Try it on your machine\n", 1)[1]
    first_block = local.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make demo", "make test"]
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_every_documented_make_target_exists():
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    named = {m for _, line in documented_lines() for m in re.findall(r"\bmake ([a-z][\w-]*)", line)}
    assert {"demo", "test"} <= named
    assert named <= targets, named - targets


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_relative_links_and_anchors_point_at_what_exists():
    for path in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if "://" in target:
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file) if file else path
            assert linked.exists(), f"{path.name}: {target}"
            if anchor:
                headings = re.findall(r"^#+ (.+)$", linked.read_text(), re.M)
                assert anchor in {_slug(h) for h in headings}, f"{path.name}: {target}"


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


def _schema_paths(schema: dict[str, Any], prefix: str) -> Iterator[str]:
    yield prefix
    for name, child in (schema.get("properties") or {}).items():
        yield from _schema_paths(child, f"{prefix}.{name}")
    if "items" in schema:
        yield from _schema_paths(schema["items"], prefix)
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        yield from _schema_paths(extra, f"{prefix}.*")


def test_every_documented_field_is_in_the_crd():
    (version,) = CRD["spec"]["versions"]
    root = version["schema"]["openAPIV3Schema"]["properties"]
    fields = {*_schema_paths(root["spec"], "spec"), *_schema_paths(root["status"], "status")}
    named = {
        (where, field.rstrip("."))
        for where, line in documented_lines()
        for field in re.findall(r"(?<![\w.])((?:spec|status)\.[A-Za-z][\w.]*)", line)
    }
    assert len(named) >= 30
    missing = sorted((where, field) for where, field in named if field not in fields)
    assert not missing, missing


def test_the_kubectl_get_sample_has_the_crds_columns():
    (version,) = CRD["spec"]["versions"]
    columns = [c["name"].upper() for c in version["additionalPrinterColumns"] if not c.get("priority")]
    sample = README.split("<!-- kubectl get columns: checked by tests/test_readme.py -->", 1)[1]
    header = sample.split("```text\n", 1)[1].splitlines()[0]
    assert header.split() == ["NAME", *columns]


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


def _metric_families() -> set[str]:
    from eagle3_operator import metrics as operator_metrics
    from eagle3_target.server.metrics import ServerMetrics
    from prometheus_client.metrics import MetricWrapperBase

    families = {family.name for family in ServerMetrics().registry.collect()}
    for value in vars(operator_metrics).values():
        if isinstance(value, MetricWrapperBase):
            families |= {family.name for family in value.describe()}
    return families


def test_every_metric_is_listed_and_every_named_metric_exists():
    families = _metric_families()
    listed = page("monitoring.md")
    missing = [name for name in families if not re.search(rf"`{name}(_total|_info)?[{{`]", listed)]
    assert len(families) >= 15 and not missing, missing
    suffix = r"(_total|_info|_bucket|_sum|_count|_created)$"
    # Metric names, not the packages (eagle3_target, eagle3_operator), their plugins, paths or modules.
    metric = r"(?<![\w./])eagle3_(?!target|operator\b)\w+(?![\w./])"
    named = {(where, n) for where, line in documented_lines() for n in re.findall(metric, line)}
    unknown = sorted(
        (where, name)
        for where, name in named
        if name not in families and re.sub(suffix, "", name) not in families
    )
    assert not unknown, unknown


def test_every_condition_reason_is_in_the_troubleshooting_table():
    from eagle3_operator.status.reasons import REASONS

    documented = table_names(page("troubleshooting.md"), "## Condition reasons")
    assert documented == set(REASONS), (set(REASONS) - documented, documented - set(REASONS))


def test_every_client_error_is_explained():
    import eagle3_target.client as client

    errors = {
        name
        for name in client.__all__
        if isinstance(getattr(client, name), type) and issubclass(getattr(client, name), Exception)
    }
    assert {"TargetNotFound", "FingerprintChanged", "TargetUnavailable"} <= errors
    assert table_names(page("troubleshooting.md"), "## Client errors") >= errors


def _commands(command: click.Command, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def _clis() -> dict[str, click.Command]:
    from eagle3_operator.cli import app as operator_app
    from eagle3_target.cli import app as target_app

    return {
        "eagle3-target": typer.main.get_command(target_app),
        "eagle3-operator": typer.main.get_command(operator_app),
    }


def _speculators_flags() -> set[str]:
    from eagle3_target.integrations.speculators import Eagle3TargetBackend

    parser = argparse.ArgumentParser()
    Eagle3TargetBackend.add_train_args(parser)
    return {opt for action in parser._actions for opt in action.option_strings}


def test_every_documented_command_and_flag_exists():
    clis = _clis()
    commands = {(program, path): cmd for program, root in clis.items() for path, cmd in _commands(root)}
    checked = 0
    for where, line in documented_lines():
        words = line.split()
        if "-m" in words and "eagle3_target.integrations.speculators" in words:
            ours = {w.split("=")[0] for w in words if w.startswith("--eagle3-target")}
            assert ours <= _speculators_flags(), (where, line)
            checked += 1
        words = [w.lstrip('"$(') for w in words]
        for program in clis:
            starts = [
                i for i, w in enumerate(words) if w == program and (i == 0 or words[i - 1] in SEPARATORS)
            ]
            if not starts:
                continue
            rest = words[starts[0] + 1 :]
            path: tuple[str, ...] = ()
            while rest and (program, (*path, rest[0])) in commands:
                path, rest = (*path, rest[0]), rest[1:]
            if not path and program == "eagle3-target" and rest and not rest[0].startswith("-"):
                continue  # prose such as "eagle3-target serve's flags" is checked where it is a command
            command = commands[(program, path)]
            options = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
            flags = {w.split("=")[0].strip("[]|,") for w in rest if w.lstrip("[").startswith("--")}
            unknown = {flag for flag in flags if flag not in options and flag != "--help"}
            assert not unknown, (where, line, unknown)
            checked += 1
    assert checked >= 15


@pytest.mark.parametrize("program", ["eagle3-target", "eagle3-operator"])
def test_help_shows_every_default(program: str):
    for path, command in _commands(_clis()[program]):
        for param in command.params:
            if not isinstance(param, click.Option) or param.is_flag or param.default in (None, ()):
                continue
            if param.hidden or param.name == "help":
                continue
            assert param.show_default, f"{program} {' '.join(path)} {param.opts[0]} hides its default"


def test_documented_chart_values_exist():
    values = yaml.safe_load((REPO / "charts" / "eagle3-operator" / "values.yaml").read_text())

    def known(key: str) -> bool:
        node: Any = values
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    named = {
        (where, key)
        for where, line in documented_lines()
        for key in re.findall(r"--set(?:-string)? '?([\w.]+)(?:\[\d+\])?=", line)
    }
    assert named
    missing = sorted((where, key) for where, key in named if not known(key))
    assert not missing, missing
    example = yaml.safe_load((REPO / "examples" / "helm-values.yaml").read_text())
    for key, value in example.items():
        assert key in values, key
        if isinstance(value, dict):
            assert set(value) <= set(values[key]), key
