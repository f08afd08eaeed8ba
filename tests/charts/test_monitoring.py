"""Monitoring as the chart ships it: with default values a target's NetworkPolicy admits the Prometheus
namespace to its metrics port and its PodMonitor carries the label kube-prometheus-stack selects; the
Grafana dashboard's and the alerts' queries name only metrics and labels the server and the operator
expose; the alerts name their target and link their runbook; the PrometheusRule and the dashboard ConfigMap
are accepted by the API server."""

from __future__ import annotations

import json
import re
from typing import Any

import kubernetes
import pytest
import yaml
from eagle3_operator import metrics as operator_metrics
from eagle3_operator.render.children import build_children
from eagle3_operator.render.network import METRICS_PORT_NAME, Neighbours
from eagle3_operator.settings import parse_labels
from eagle3_operator.spec import Eagle3TargetSpec
from eagle3_operator.status.reasons import READY, REASONS
from eagle3_target.server.metrics import ServerMetrics
from prometheus_client.metrics import MetricWrapperBase

from support.chart import (
    CHART,
    PROMETHEUS_RULE_CRD,
    VALUE_SETS,
    by_kind,
    cli_options,
    helm,
    notes,
    operator_container,
    render,
    set_args,
)
from support.cluster.access import REPO
from support.promql import PromQLError, parse, read
from support.rendering import UID

MONITORING = VALUE_SETS["dashboard and alerts"]
# The labels prometheus-operator gives every series it scrapes through a PodMonitor (job:
# <namespace>/<PodMonitor name>) and, with service, through a ServiceMonitor.
SCRAPE_LABELS = frozenset({"namespace", "pod", "container", "endpoint", "job", "instance"})
SERVICE_MONITOR_LABELS = SCRAPE_LABELS | {"service"}
ALERTS = {
    "Eagle3TargetDegraded",
    "Eagle3TargetModelLoadFailed",
    "Eagle3TargetQueueSaturated",
    "Eagle3TargetWakeStuck",
}


def exposed(metric: MetricWrapperBase, scrape: frozenset[str]) -> dict[str, frozenset[str]]:
    """The series names one metric exposes (its type's suffixes) and the labels each carries once scraped."""
    (family,) = metric.describe()
    labels = frozenset(metric._labelnames) | scrape
    suffixes = {
        "counter": {"_total": labels, "_created": labels},
        "gauge": {"": labels},
        "histogram": {"_bucket": labels | {"le"}, "_sum": labels, "_count": labels, "_created": labels},
        "info": {"_info": labels},
    }[family.type]
    return {family.name + suffix: have for suffix, have in suffixes.items()}


def target_children(name: str, neighbours: Neighbours) -> list[dict[str, Any]]:
    """What the operator renders for a target named `name` in ml-training with a NetworkPolicy and a
    PodMonitor."""
    spec = Eagle3TargetSpec.parse(
        {
            "model": {"name": "m", "source": {"pvc": {"claimName": "weights"}}},
            "networkPolicy": {"enabled": True},
            "monitoring": {"podMonitor": {"enabled": True}},
        }
    )
    return build_children(name, "ml-training", UID, spec, pod_monitor_supported=True, neighbours=neighbours)


def target_pod_monitor(name: str) -> dict[str, Any]:
    (monitor,) = by_kind(target_children(name, Neighbours("eagle3-system", "monitoring", {})), "PodMonitor")
    return monitor


def pod_monitor_labels() -> frozenset[str]:
    """The labels a target server's series carry once scraped: prometheus-operator's and those the
    operator's PodMonitor adds by relabeling (`target`)."""
    (endpoint,) = target_pod_monitor("llama31-8b")["spec"]["podMetricsEndpoints"]
    return SCRAPE_LABELS | {r["targetLabel"] for r in endpoint.get("relabelings", [])}


def scraped_families() -> dict[str, dict[str, frozenset[str]]]:
    """Every metric of the target server (scraped through its PodMonitor) and of the operator (through the
    chart's ServiceMonitor): its series names and their labels, read from the metrics objects themselves."""
    server = ServerMetrics()
    scrape = pod_monitor_labels()
    metrics = [(m, scrape) for m in vars(server).values() if isinstance(m, MetricWrapperBase)]
    # Every metric the server's registry serves is among them.
    assert {m.describe()[0].name for m, _ in metrics} == {f.name for f in server.registry.collect()}
    metrics += [
        (m, SERVICE_MONITOR_LABELS)
        for m in vars(operator_metrics).values()
        if isinstance(m, MetricWrapperBase)
    ]
    return {metric.describe()[0].name: exposed(metric, scrape) for metric, scrape in metrics}


def scraped_series() -> dict[str, frozenset[str]]:
    return {name: labels for family in scraped_families().values() for name, labels in family.items()}


def dashboard_configmap() -> dict[str, Any]:
    (configmap,) = by_kind(render(MONITORING), "ConfigMap")
    return configmap


def dashboard_queries() -> list[str]:
    """Every panel query, and the metric selector of every label_values() variable."""
    dashboard = json.loads(dashboard_configmap()["data"]["eagle3.json"])
    queries = [
        target["expr"]
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        if target.get("expr")
    ]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"]
            variable_query = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
            assert variable_query, query
            selector, label = variable_query.groups()
            queries.append(f"max by ({label}) ({selector})")
    return queries


def alerting_rules(values: dict[str, str]) -> list[dict[str, Any]]:
    (rule,) = by_kind(render(values), "PrometheusRule")
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def test_dashboard_configmap_is_valid_json_with_the_sidecars_label():
    configmap = dashboard_configmap()
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == "grafana"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "Eagle3"}
    dashboard = json.loads(configmap["data"]["eagle3.json"])
    assert dashboard["uid"] and dashboard["title"]
    assert {v["name"] for v in dashboard["templating"]["list"]} >= {"namespace", "target"}
    # Off by default, and in the release namespace unless told otherwise.
    assert not by_kind(render({}), "ConfigMap")
    (default_place,) = by_kind(render({"grafana.dashboard.enabled": "true"}), "ConfigMap")
    assert default_place["metadata"]["namespace"] == "eagle3-system"


def test_every_dashboard_query_names_metrics_and_labels_that_exist():
    series = scraped_series()
    queries = dashboard_queries()
    assert len(queries) >= 20
    unknown = {query: names for query in queries if (names := read(query, series).unknown)}
    assert not unknown, "\n".join(f"{names} in {query}" for query, names in unknown.items())


def test_the_dashboard_leaves_out_only_these_metrics():
    """A metric the dashboard does not show is a choice: a new metric gets a panel or a line here."""
    used = {name for query in dashboard_queries() for name in re.findall(r"eagle3_\w+", query)}
    left_out = {family for family, series in scraped_families().items() if not used & series.keys()}
    assert left_out == {
        "eagle3_model",  # the model's identity, not a time series
        "eagle3_operator_api_requests",
        "eagle3_operator_child_applies",
        "eagle3_operator_status_writes",
        "eagle3_operator_probes",
    }


def test_every_alert_names_metrics_and_labels_that_exist_and_the_target():
    series = scraped_series()
    rules = alerting_rules(MONITORING)
    assert {r["alert"] for r in rules} == ALERTS
    for rule in rules:
        reading = read(rule["expr"], series)
        assert not reading.unknown, (rule["alert"], reading.unknown)
        assert reading.labels is not None and {"namespace", "target"} <= reading.labels, rule["alert"]


def test_every_documented_query_names_metrics_and_labels_that_exist():
    """The PromQL examples of the docs (```promql blocks) hold to the same names as the dashboard."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    blocks = [b for page in pages for b in re.findall(r"```promql\n(.*?)```", page.read_text(), re.DOTALL)]
    queries = [q for block in blocks for q in block.split("\n\n") if q.strip()]
    assert queries
    series = scraped_series()
    unknown = {query: names for query in queries if (names := read(query, series).unknown)}
    assert not unknown, unknown


def test_alerts_carry_their_settings_severity_and_runbook():
    rules = {r["alert"]: r for r in alerting_rules(MONITORING)}
    assert rules["Eagle3TargetDegraded"]["for"] == "15m"
    assert rules["Eagle3TargetWakeStuck"]["expr"].endswith("> 3600")
    defaults = {r["alert"]: r for r in alerting_rules({"prometheusRule.enabled": "true"})}
    assert defaults["Eagle3TargetDegraded"]["for"] == "10m"
    assert defaults["Eagle3TargetWakeStuck"]["expr"].endswith("> 1800")
    for name, rule in rules.items():
        assert rule["labels"] == {"severity": defaults[name]["labels"]["severity"], "team": "ml-platform"}
        annotations = rule["annotations"]
        assert "{{ $labels.target }}" in annotations["summary"] and annotations["description"]
        page, anchor = annotations["runbook_url"].split("#")
        assert page == "https://github.com/eagle3-dev/eagle3-target/blob/main/docs/troubleshooting.md"
        assert anchor == name.lower()
    (rule,) = by_kind(render({"prometheusRule.enabled": "true"}), "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert not by_kind(render({}), "PrometheusRule")


def test_alert_labels_win_over_the_severity_without_a_second_key():
    """A `severity` among alertLabels replaces each alert's own (a YAML loader would quietly keep the last of
    two keys, so the rendered text is read); a Prometheus label name Kubernetes would refuse is accepted."""
    values = {
        "prometheusRule.enabled": "true",
        "prometheusRule.alertLabels.severity": "page",
        "prometheusRule.alertLabels._team": "ml",
    }
    text = helm(
        "template", "e3", str(CHART), "--show-only", "templates/prometheusrule.yaml", *set_args(values)
    ).stdout
    assert len(re.findall(r"^\s+severity:", text, re.MULTILINE)) == len(ALERTS)
    for rule in alerting_rules(values):
        assert rule["labels"] == {"severity": "page", "_team": "ml"}, rule["alert"]


def test_each_runbook_url_has_its_section_in_the_troubleshooting_page():
    """GitHub's anchor of a heading is its text in lower case: each alert has a heading of its name."""
    page = (REPO / "docs" / "troubleshooting.md").read_text()
    headings = {line.lstrip("#").strip().strip("`") for line in page.splitlines() if line.startswith("#")}
    assert headings >= ALERTS, ALERTS - headings


def test_the_load_failure_alert_names_failure_reasons_of_the_ready_condition():
    (rule,) = [r for r in alerting_rules(MONITORING) if r["alert"] == "Eagle3TargetModelLoadFailed"]
    (reasons,) = re.findall(r'reason=~"([^"]+)"', rule["expr"])
    assert reasons.split("|") == ["ModelLoadFailed", "ModelDownloadFailed", "EngineFailed"]
    for reason in reasons.split("|"):
        assert READY in REASONS[reason], reason


@pytest.mark.parametrize(
    ("query", "unknown"),
    [
        ("rate(eagle3_request_total[5m])", ["metric eagle3_request_total"]),
        ('sum(eagle3_queue_depth{model="x"})', ["label model on eagle3_queue_depth"]),
        ("sum by (route) (eagle3_queue_depth)", ["label route in sum by"]),
        (
            "histogram_quantile(0.9, sum by (route) (rate(eagle3_request_duration_seconds_bucket[5m])))",
            ["label le (histogram_quantile of no buckets)"],
        ),
        (
            'label_replace(eagle3_tokens_total, "t", "$1", "pod_name", "(.*)")',
            ["label pod_name (label_replace's source)"],
        ),
        ("max by (le) (eagle3_operator_reconcile_duration_seconds_bucket) > 1", []),
    ],
)
def test_the_name_check_finds_what_is_wrong(query, unknown):
    """The check fails where it should: a misspelt metric, a label a metric lacks, a grouping or a source
    label that is not there, a quantile over no buckets."""
    assert read(query, scraped_series()).unknown == unknown


@pytest.mark.parametrize(
    "query", ["sum(", "nosuchfunction(eagle3_queue_depth)", "eagle3_queue_depth offset 5m"]
)
def test_queries_outside_the_read_subset_are_refused(query):
    with pytest.raises(PromQLError):
        parse(query)


def test_default_values_let_prometheus_scrape_a_target_behind_its_network_policy():
    """The chart's args, parsed by the operator's own command line, go where the operator puts them: a
    target's NetworkPolicy admits the default Prometheus namespace to the metrics port, and its PodMonitor
    carries the label kube-prometheus-stack selects PodMonitors by."""
    options = cli_options(operator_container(render({}))["args"])
    neighbours = Neighbours(
        "eagle3-system", options["prometheus_namespace"], parse_labels(options["pod_monitor_label"] or [])
    )
    children = target_children("llama31-8b", neighbours)
    (policy,) = by_kind(children, "NetworkPolicy")
    (metrics_rule,) = [
        rule
        for rule in policy["spec"]["ingress"]
        if rule["ports"] == [{"protocol": "TCP", "port": METRICS_PORT_NAME}]
    ]
    (peer,) = metrics_rule["from"]
    (expression,) = peer["namespaceSelector"]["matchExpressions"]
    assert expression["values"] == ["monitoring"]
    (monitor,) = by_kind(children, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


@pytest.mark.parametrize("name", ["llama31-8b", "llama-3.1-8b", "a" * 70])
def test_server_series_carry_the_targets_own_name(name):
    """The alerts and the dashboard find a target's server series by their `target` label, which the
    PodMonitor sets to the resource's name: its own name (and so prometheus-operator's job,
    <namespace>/<PodMonitor name>) differs for dotted or long names."""
    monitor = target_pod_monitor(name)
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert {"action": "replace", "targetLabel": "target", "replacement": name} in endpoint["relabelings"]
    assert monitor["metadata"]["namespace"] == "ml-training"
    assert (monitor["metadata"]["name"] == name) is (name == "llama31-8b")
    # Neither reads job.
    rule_queries = [r["expr"] for r in alerting_rules(MONITORING)]
    assert not [q for q in [*dashboard_queries(), *rule_queries] if "job" in q]


def test_one_value_labels_the_pod_monitors_and_the_operators_service_monitor():
    values = {
        "metrics.serviceMonitor.enabled": "true",
        "targets.podMonitorLabels.release": "prom",
        "targets.podMonitorLabels.team": "ml",
    }
    objects = render(values)
    assert cli_options(operator_container(objects)["args"])["pod_monitor_label"] == [
        "release=prom",
        "team=ml",
    ]
    (monitor,) = by_kind(objects, "ServiceMonitor")
    assert {"release": "prom", "team": "ml"}.items() <= monitor["metadata"]["labels"].items()
    # Per-target series keep their target's namespace rather than becoming exported_namespace.
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True
    # The ServiceMonitor's own labels win over the PodMonitors'.
    (own,) = by_kind(render({**values, "metrics.serviceMonitor.labels.release": "ops"}), "ServiceMonitor")
    assert own["metadata"]["labels"]["release"] == "ops"


@pytest.mark.parametrize(
    ("values_file", "values"),
    [
        ({"targets": {"podMonitorLabels": {"release": None}}}, {}),
        ({}, {"targets.podMonitorLabels.release": "null"}),
        ({}, {"targets.podMonitorLabels": "null"}),
    ],
)
def test_a_null_removes_the_default_pod_monitor_label(values_file, values):
    """The form values.yaml and the chart's README give: Helm merges maps, so only a null removes the
    default `release` label (and then no flag is passed)."""
    args = operator_container(render(values, values_file=values_file))["args"]
    assert not cli_options(args)["pod_monitor_label"]
    assert not [arg for arg in args if arg.startswith("--pod-monitor-label")]


def test_an_empty_map_keeps_the_default_labels():
    """Why values.yaml does not offer `{}`: Helm merges it into the defaults, which stay."""
    values_file = {
        "targets": {"podMonitorLabels": {}},
        "prometheusRule": {"enabled": True, "labels": {}},
    }
    objects = render({}, values_file=values_file)
    assert cli_options(operator_container(objects)["args"])["pod_monitor_label"] == [
        "release=kube-prometheus-stack"
    ]
    (rule,) = by_kind(objects, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_a_null_removes_the_default_rule_and_dashboard_labels():
    values_file = {
        "prometheusRule": {"enabled": True, "labels": {"release": None}},
        "grafana": {
            "dashboard": {"enabled": True, "labels": {"grafana_dashboard": None, "dashboards": "e3"}}
        },
    }
    objects = render({}, values_file=values_file)
    (rule,) = by_kind(objects, "PrometheusRule")
    assert "release" not in rule["metadata"]["labels"]
    (configmap,) = by_kind(objects, "ConfigMap")
    assert "grafana_dashboard" not in configmap["metadata"]["labels"]
    assert configmap["metadata"]["labels"]["dashboards"] == "e3"


@pytest.mark.parametrize("case", sorted(VALUE_SETS))
def test_the_chart_notes_name_files_that_exist(case):
    """NOTES.txt renders for every value set and every repository path it names exists."""
    text = notes(VALUE_SETS[case])
    # The README's quick-start commands, all of them and in their order (the Secrets and the training
    # script's ConfigMap before the apply that starts the target and the Job).
    readme = (REPO / "README.md").read_text()
    (block,) = re.findall(r"<!-- quick start.*?```bash\n(.*?)```", readme, re.DOTALL)
    commands = [line.strip() for line in text.splitlines() if line.startswith("  kubectl ")]
    assert commands == block.strip().splitlines()
    paths = re.findall(r"\b(?:examples|docs)/[\w./-]*\w/?|README\.md", text)
    paths += [f"docs/{page}" for page in re.findall(r"(?<!/)\b(\w+\.md)\b", text) if page != "README.md"]
    assert len(paths) >= 5
    missing = [path for path in paths if not (REPO / path).exists()]
    assert not missing, missing
    served = "ml-training" in VALUE_SETS[case].get("watchNamespaces", "{ml-training}")
    assert ("does not serve ml-training" in text) is not served
    unscraped = case == "dashboard and alerts"  # on without the operator's ServiceMonitor
    assert ("metrics.serviceMonitor.enabled is\nfalse" in text) is unscraped


def test_the_prometheus_rule_and_dashboard_are_accepted_by_the_api_server(cluster, namespace):
    """Installed with the chart on the control plane, with a PrometheusRule CRD whose structural schema
    refuses unknown fields: stored as rendered, nothing pruned."""
    cluster.kubectl("apply", "--server-side", "-f", str(PROMETHEUS_RULE_CRD))
    cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "crd/prometheusrules.monitoring.coreos.com"
    )
    values = {**MONITORING, "grafana.dashboard.namespace": namespace}
    try:
        cluster.helm("install", "e3", str(CHART), "-n", namespace, *set_args(values))
        custom = kubernetes.client.CustomObjectsApi(cluster.api_client)
        stored = custom.get_namespaced_custom_object(
            "monitoring.coreos.com", "v1", namespace, "prometheusrules", "e3-eagle3-operator"
        )
        (rendered,) = by_kind(render(values, namespace), "PrometheusRule")
        assert stored["spec"] == rendered["spec"]
        core = kubernetes.client.CoreV1Api(cluster.api_client)
        configmap = core.read_namespaced_config_map("e3-eagle3-operator-dashboard", namespace)
        assert configmap.metadata.labels["grafana_dashboard"] == "1"
        assert json.loads(configmap.data["eagle3.json"])["uid"] == "eagle3-target"
        # The schema is not a stand-in that takes anything: a rule without an expression is refused.
        broken = {
            **rendered,
            "metadata": {"name": "broken", "namespace": namespace},
            "spec": {"groups": [{"name": "g", "rules": [{"alert": "A"}]}]},
        }
        refused = cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(broken), check=False)
        assert refused.returncode != 0 and "expr" in refused.stderr
        # Nor a field the real CRD does not have where it was written (strict field validation).
        broken["spec"]["groups"][0]["rules"] = [{"alert": "A", "expr": "1", "summary": "misplaced"}]
        refused = cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(broken), check=False)
        assert refused.returncode != 0 and 'unknown field "spec.groups[0].rules[0].summary"' in refused.stderr
    finally:
        cluster.helm("uninstall", "e3", "-n", namespace, check=False)
        # Gone before the next test or a rerun, which would otherwise meet a Terminating CRD.
        cluster.kubectl(
            "delete", "crd", "prometheusrules.monitoring.coreos.com", "--timeout=60s", check=False
        )
