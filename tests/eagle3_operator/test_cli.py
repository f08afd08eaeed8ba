"""The `eagle3-operator` command line refuses an ambiguous scope before it touches any cluster."""

import pytest
from eagle3_operator.cli import app
from typer.testing import CliRunner


@pytest.mark.parametrize("args", [[], ["--all-namespaces", "--namespace", "team-a"]])
def test_scope_must_be_namespaces_or_all(args):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert "--namespace (repeatable) or --all-namespaces" in result.output


def test_help_names_the_operational_flags():
    result = CliRunner().invoke(app, ["--help"], terminal_width=200)
    assert result.exit_code == 0
    for flag in (
        "--namespace",
        "--all-namespaces",
        "--liveness",
        "--metrics-port",
        "--standalone",
        "--peering",
    ):
        assert flag in result.output
