"""The operator's Helm chart as tests read it: helm without a cluster, the objects it renders for a value
set, the operator's options parsed from the rendered args, and the value sets the chart is checked with."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import typer
import yaml
from eagle3_operator import cli

from support.cluster.access import BIN_DIR, HELM_ENV, REPO

CHART = REPO / "charts" / "eagle3-operator"
CRD_NAME = "eagle3targets.eagle3.dev.yaml"

# Value sets every rendering check runs with: each turns on a different part of the chart.
VALUE_SETS: dict[str, dict[str, str]] = {
    "defaults": {},
    "two namespaces": {"watchNamespaces": "{team-a,team-b}"},
    "service monitor": {
        "metrics.serviceMonitor.enabled": "true",
        "metrics.serviceMonitor.labels.release": "prom",
    },
    "own account and ports": {
        "serviceAccount.create": "false",
        "serviceAccount.name": "existing-operator",
        "healthPort": "9000",
        "metrics.port": "9001",
        "logLevel": "debug",
        "image.tag": "dev",
    },
    "no metrics service": {"metrics.service.enabled": "false"},
    "other prometheus, no user roles": {
        "targets.prometheusNamespace": "prometheus",
        "targets.podMonitorLabels.prometheus": "main",
        "targets.podMonitorLabels.release": "null",
        "rbac.aggregateToDefaultRoles": "false",
    },
    "dashboard and alerts": {
        "grafana.dashboard.enabled": "true",
        "grafana.dashboard.namespace": "grafana",
        "grafana.dashboard.annotations.grafana_folder": "Eagle3",
        "prometheusRule.enabled": "true",
        "prometheusRule.alertLabels.team": "ml-platform",
        "prometheusRule.degraded.for": "15m",
        "prometheusRule.wakeStuck.pendingSeconds": "3600",
    },
}
# prometheus-operator's PrometheusRule CRD as the tests install it (the chart's alerts need it).
PROMETHEUS_RULE_CRD = REPO / "support" / "crds" / "prometheusrules.monitoring.coreos.com.yaml"


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """helm without a cluster (lint, template), with its state dirs kept inside .cache."""
    result = subprocess.run(
        [str(BIN_DIR / "helm"), *args], capture_output=True, text=True, env=HELM_ENV, timeout=60
    )
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stderr}")
    return result


def set_args(values: dict[str, str]) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def render(
    values: dict[str, str], namespace: str = "eagle3-system", values_file: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The chart rendered with `--set` values and, when given, a values file as a user writes one (its maps
    merge into the defaults; a null removes a key)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as file:
        yaml.safe_dump(values_file or {}, file)
        file.flush()
        out = helm(
            "template", "e3", str(CHART), "--namespace", namespace, "-f", file.name, *set_args(values)
        ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = by_kind(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def cli_options(args: list[str]) -> dict[str, Any]:
    """Parse the container's args with the operator's real command line (nothing runs)."""
    command = typer.main.get_command(cli.app)
    return command.make_context("eagle3-operator", list(args)).params


def notes(values: dict[str, str], namespace: str = "eagle3-system") -> str:
    """NOTES.txt as `helm install` prints it. `helm template` renders no notes and `helm install` needs a
    cluster with every CRD the value set uses, so a copy of the chart renders them as a document."""
    with tempfile.TemporaryDirectory() as scratch:
        chart = Path(scratch) / CHART.name
        shutil.copytree(CHART, chart)
        text = (CHART / "templates" / "NOTES.txt").read_text()
        wrapper = (
            f'{{{{- define "notes" }}}}{text}{{{{- end }}}}\nnotes: {{{{ include "notes" . | toJson }}}}\n'
        )
        (chart / "templates" / "notes.yaml").write_text(wrapper)
        show = ("--show-only", "templates/notes.yaml")
        out = helm("template", "e3", str(chart), "--namespace", namespace, *show, *set_args(values)).stdout
    return str(yaml.safe_load(out)["notes"])
