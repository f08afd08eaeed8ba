"""The operator's Prometheus metrics, served on their own port by the CLI.

Gauges describe the targets this operator instance reconciles; counters count its work, so a flat
`eagle3_operator_status_writes_total` over an idle period shows the operator is not churning.
"""

from collections.abc import Collection

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter(
    "eagle3_operator_reconciles_total",
    "Reconcile passes over one Eagle3Target, by result (ok, invalid_spec, error).",
    ["result"],
)
RECONCILE_DURATION = Histogram(
    "eagle3_operator_reconcile_duration_seconds",
    "Time for one reconcile pass: apply, probe, status.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
TARGETS = Gauge("eagle3_operator_targets", "Eagle3Targets by status.phase.", ["phase"])
READY_ENDPOINTS = Gauge("eagle3_operator_ready_endpoints", "Ready target-server endpoints over all targets.")
API_REQUESTS = Counter(
    "eagle3_operator_api_requests_total",
    "Kubernetes API requests made by the reconciler (kopf's own watches are not included), by method.",
    ["method"],
)
CHILD_APPLIES = Counter("eagle3_operator_child_applies_total", "Server-side applies of children.", ["kind"])
STATUS_WRITES = Counter("eagle3_operator_status_writes_total", "Status patches written.")
PROBES = Counter("eagle3_operator_probes_total", "Target-server probes, by outcome.", ["outcome"])
IDLE_SCALE_DOWNS = Counter(
    "eagle3_operator_idle_scale_downs_total", "Targets scaled to zero pods after spec.idle.scaleToZeroAfter."
)
WAKE_UPS = Counter("eagle3_operator_wake_ups_total", "Idle targets woken (the wake annotation changed).")

PHASES = ("Pending", "Loading", "Ready", "Degraded", "Failed", "Suspended", "Idle")


def publish_targets(targets: Collection[tuple[str, int]]) -> None:
    """Set the gauges from the reconciler's view of every target it knows: (phase, ready endpoints) each."""
    for phase in PHASES:
        TARGETS.labels(phase=phase).set(sum(1 for p, _ in targets if p == phase))
    READY_ENDPOINTS.set(sum(ready for _, ready in targets))
