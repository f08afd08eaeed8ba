"""The `eagle3-operator` command line refuses an ambiguous scope or a malformed PodMonitor label before it
touches any cluster, shows every option's default, and picks kopf's settings for the scope it is given."""

import kopf
import pytest
import typer
from eagle3_operator.cli import app
from eagle3_operator.settings import OperatorConfig, configure, needs_cluster_scanning, parse_labels
from typer.testing import CliRunner


@pytest.mark.parametrize("args", [[], ["--all-namespaces", "--namespace", "team-a"]])
def test_scope_must_be_namespaces_or_all(args):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert "--namespace (repeatable) or --all-namespaces" in result.output


def test_help_names_the_operational_flags():
    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for flag in (
        "--namespace",
        "--all-namespaces",
        "--liveness",
        "--readiness",
        "--metrics-port",
        "--operator-namespace",
        "--prometheus-namespace",
        "--leader-elect",
        "--leader-election-namespace",
        "--server-image",
        "--pod-monitor-label",
    ):
        assert flag in result.output


def test_help_shows_every_options_default():
    command = typer.main.get_command(app)
    context = command.context_class(command)
    options = [p for p in command.params if isinstance(p, typer.core.TyperOption) and p.name != "help"]
    assert len(options) > 10
    for option in options:
        record = option.get_help_record(context)
        assert record is not None and "default: " in record[1], option.name


@pytest.mark.parametrize(
    ("label", "why"),
    [
        ("release", "is not KEY=VALUE"),
        ("app.kubernetes.io/name=x", "is set by the operator"),
        ("release=not a value", "is not a label value"),
        ("-bad=x", "is not a qualified name"),
    ],
)
def test_a_malformed_pod_monitor_label_stops_the_start(label, why):
    result = CliRunner().invoke(app, ["-A", "--pod-monitor-label", label], env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert "--pod-monitor-label" in result.output and why in result.output


def test_pod_monitor_labels_parse_into_a_mapping():
    pairs = ["release=kube-prometheus-stack", "example.com/team=ml", "empty="]
    assert parse_labels(pairs) == {"release": "kube-prometheus-stack", "example.com/team": "ml", "empty": ""}


@pytest.mark.parametrize(
    ("namespaces", "all_namespaces", "scanning_disabled"),
    [
        (["team-a"], False, True),
        (["team-a", "team-b"], False, True),
        (["team-*"], False, False),
        (["team-a", "ml-?"], False, False),
        (["!kube-system"], False, False),
        (["team-a,team-b"], False, False),
        ([], True, True),
    ],
)
def test_only_namespace_patterns_need_kopfs_cluster_scanning(namespaces, all_namespaces, scanning_disabled):
    """Exact names are served as given (no Namespace watch to miss new ones) and cluster-wide needs no
    Namespace list nor a watch of every CRD; only patterns make kopf watch Namespaces."""
    config = OperatorConfig(api_timeout_seconds=5.0, scan_cluster=needs_cluster_scanning(namespaces))
    settings = kopf.OperatorSettings()
    configure(settings, config)
    assert settings.scanning.disabled is scanning_disabled
    assert settings.networking.request_timeout == 5.0
