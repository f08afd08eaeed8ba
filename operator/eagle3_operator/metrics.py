"""The operator's Prometheus metrics, served on their own port by the CLI.

Gauges describe the targets this operator instance reconciles; counters count its work, so a flat
`eagle3_operator_status_writes_total` over an idle period shows the operator is not churning. The per-target
gauges (each condition, a pending wake) let an alert name the target; `TargetSeries` keeps them to the
targets and reasons of now.
"""

from collections.abc import Callable, Collection, Iterable, Mapping
from datetime import datetime

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

TARGET_CONDITION = Gauge(
    "eagle3_operator_target_condition",
    "Each condition of each Eagle3Target: 1 while True, 0 while False or Unknown; reason is its current"
    " reason (one series per target and condition).",
    ["namespace", "target", "condition", "reason"],
)
WAKE_PENDING = Gauge(
    "eagle3_operator_target_wake_pending_seconds",
    "Seconds since an idle Eagle3Target was asked to wake (its eagle3.dev/wake-requested-at annotation),"
    " while it has not been Available since; 0 otherwise.",
    ["namespace", "target"],
)

# (namespace, target) -> condition type -> the reason its published series carries.
SeriesReasons = dict[tuple[str, str], dict[str, str]]

PHASES = ("Pending", "Loading", "Ready", "Degraded", "Failed", "Suspended", "Idle")


def publish_targets(targets: Collection[tuple[str, int]]) -> None:
    """Set the gauges from the reconciler's view of every target it knows: (phase, ready endpoints) each."""
    for phase in PHASES:
        TARGETS.labels(phase=phase).set(sum(1 for p, _ in targets if p == phase))
    READY_ENDPOINTS.set(sum(ready for _, ready in targets))


class TargetSeries:
    """The per-target series this process publishes: one per condition (a changed reason replaces its
    series), and the wake gauge, which reads the clock when scraped so it grows between passes."""

    def __init__(self, clock: Callable[[], datetime]) -> None:
        self._clock = clock
        self._reasons: SeriesReasons = {}

    def publish(
        self, key: tuple[str, str], conditions: Iterable[Mapping[str, str]], wake_since: datetime | None
    ) -> None:
        """Set a target's series from its status conditions and the pending wake's start (None: none)."""
        reasons = self._reasons.setdefault(key, {})
        for condition in conditions:
            kind, reason = condition["type"], condition["reason"]
            old = reasons.get(kind)
            if old is not None and old != reason:
                TARGET_CONDITION.remove(*key, kind, old)
            reasons[kind] = reason
            TARGET_CONDITION.labels(*key, kind, reason).set(1 if condition["status"] == "True" else 0)
        clock = self._clock
        WAKE_PENDING.labels(*key).set_function(
            lambda: 0.0 if wake_since is None else max(0.0, (clock() - wake_since).total_seconds())
        )

    def remove(self, key: tuple[str, str]) -> None:
        """Drop every series of a target this process no longer serves."""
        if key not in self._reasons:
            return
        for kind, reason in self._reasons.pop(key).items():
            TARGET_CONDITION.remove(*key, kind, reason)
        WAKE_PENDING.remove(*key)
