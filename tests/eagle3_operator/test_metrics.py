"""The per-target gauges without a cluster: one condition series per target and condition that follows its
reason, a wake gauge that grows with the clock between passes, and nothing left once a target goes."""

from datetime import timedelta

from eagle3_operator.metrics import TargetSeries
from prometheus_client import REGISTRY

from support.observations import T0

KEY = ("ml", "series-unit")


def condition(kind: str, status: str, reason: str) -> dict[str, str]:
    return {"type": kind, "status": status, "reason": reason}


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"namespace": KEY[0], "target": KEY[1], **labels})


def series_of_target() -> list[dict[str, str]]:
    return [
        s.labels
        for metric in REGISTRY.collect()
        for s in metric.samples
        if s.name.startswith("eagle3_operator_target_") and s.labels.get("target") == KEY[1]
    ]


def test_condition_series_follow_the_reason_and_a_wake_grows_until_cleared():
    now = [T0]
    series = TargetSeries(lambda: now[0])
    series.publish(
        KEY, [condition("Ready", "False", "Loading"), condition("Degraded", "False", "AsExpected")], T0
    )
    assert sample("eagle3_operator_target_condition", condition="Ready", reason="Loading") == 0
    assert sample("eagle3_operator_target_condition", condition="Degraded", reason="AsExpected") == 0
    now[0] = T0 + timedelta(seconds=42)  # no pass in between: the gauge reads the clock when scraped
    assert sample("eagle3_operator_target_wake_pending_seconds") == 42

    series.publish(KEY, [condition("Ready", "True", "AllReplicasReady")], None)
    assert sample("eagle3_operator_target_condition", condition="Ready", reason="AllReplicasReady") == 1
    assert sample("eagle3_operator_target_condition", condition="Ready", reason="Loading") is None
    assert sample("eagle3_operator_target_wake_pending_seconds") == 0
    assert len([s for s in series_of_target() if s.get("condition") == "Ready"]) == 1

    series.remove(KEY)
    assert series_of_target() == []
    series.remove(KEY)  # a target never published, or already removed: nothing to do
