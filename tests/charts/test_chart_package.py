"""The chart as a package, with the real helm binary: its CRD is the source CRD, it lints clean with every
value set, and its schema refuses bad values with a message that names them."""

import pytest

from support.chart import CHART, CRD_NAME, VALUE_SETS, helm, set_args
from support.cluster.access import REPO


def test_chart_crds_are_the_source_crds():
    source = REPO / "crds" / CRD_NAME
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == [CRD_NAME]
    assert (CHART / "crds" / CRD_NAME).read_bytes() == source.read_bytes()


@pytest.mark.parametrize("case", sorted(VALUE_SETS))
def test_lint_strict(case):
    result = helm("lint", "--strict", str(CHART), *set_args(VALUE_SETS[case]))
    assert "0 chart(s) failed" in result.stdout


BAD_VALUES = {
    "namespaces as a string": ({"watchNamespaces": "all"}, "at '/watchNamespaces': got string, want array"),
    "bad namespace name": ({"watchNamespaces": "{Team_A}"}, "'Team_A' does not match pattern"),
    "privileged port": ({"healthPort": "80"}, "at '/healthPort': minimum"),
    "same two ports": ({"metrics.port": "8080"}, "healthPort, readinessPort and metrics.port must differ"),
    "readiness on the health port": (
        {"readinessPort": "8080"},
        "healthPort, readinessPort and metrics.port must differ",
    ),
    "pull policy": (
        {"image.pullPolicy": "Sometimes"},
        "value must be one of 'Always', 'IfNotPresent', 'Never'",
    ),
    "unknown key": ({"replica": "2"}, "additional properties 'replica' not allowed"),
    "two replicas without election": (
        {"replicas": "2", "leaderElection.enabled": "false"},
        "at '/leaderElection/enabled': value must be true",
    ),
    "monitor without service": (
        {"metrics.serviceMonitor.enabled": "true", "metrics.service.enabled": "false"},
        "at '/metrics/service/enabled': value must be true",
    ),
    "no account": ({"serviceAccount.create": "false"}, "at '/serviceAccount/name'"),
    "bad quantity": ({"resources.limits.memory": "lots"}, "at '/resources/limits/memory'"),
    "log level": ({"logLevel": "trace"}, "at '/logLevel'"),
    "bad prometheus namespace": (
        {"targets.prometheusNamespace": "Mon_1"},
        "at '/targets/prometheusNamespace'",
    ),
    "pod monitor labels as a list": (
        {"targets.podMonitorLabels": "{release}"},
        "at '/targets/podMonitorLabels': got array, want object",
    ),
    "pod monitor label value": (
        {"targets.podMonitorLabels.release": "kube prometheus"},
        "at '/targets/podMonitorLabels/release'",
    ),
    "pod monitor label key": ({"targets.podMonitorLabels.bad key": "x"}, "invalid propertyName 'bad key'"),
    "dashboard without a label": (
        {"grafana.dashboard.labels": "null", "grafana.dashboard.enabled": "true"},
        "at '/grafana/dashboard': missing property 'labels'",
    ),
    "dashboard namespace": ({"grafana.dashboard.namespace": "Grafana"}, "at '/grafana/dashboard/namespace'"),
    "unknown dashboard key": ({"grafana.dashboards.enabled": "true"}, "additional properties 'dashboards'"),
    "alert duration": ({"prometheusRule.degraded.for": "ten minutes"}, "at '/prometheusRule/degraded/for'"),
    "queue depth": (
        {"prometheusRule.queueSaturated.queueDepth": "0"},
        "at '/prometheusRule/queueSaturated/queueDepth'",
    ),
    "rejections per second": (
        {"prometheusRule.queueSaturated.rejectedPerSecond": "0"},
        "at '/prometheusRule/queueSaturated/rejectedPerSecond'",
    ),
    "wake threshold": (
        {"prometheusRule.wakeStuck.pendingSeconds": "soon"},
        "at '/prometheusRule/wakeStuck/pendingSeconds'",
    ),
    "runbook url": (
        {"prometheusRule.runbookBaseUrl": "docs/troubleshooting.md"},
        "at '/prometheusRule/runbookBaseUrl'",
    ),
    "rule labels": ({"prometheusRule.labels": "release"}, "at '/prometheusRule/labels'"),
    # A Kubernetes label name, not a Prometheus one (letters, digits and underscores).
    "alert label with a dash": (
        {"prometheusRule.alertLabels.team-name": "ml"},
        "invalid propertyName 'team-name'",
    ),
    "alert label with a prefix": (
        {"prometheusRule.alertLabels.example\\.com/team": "ml"},
        "invalid propertyName 'example.com/team'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_values_are_refused(case):
    values, expected = BAD_VALUES[case]
    result = helm("template", "e3", str(CHART), *set_args(values), check=False)
    assert result.returncode != 0
    assert expected in result.stderr
