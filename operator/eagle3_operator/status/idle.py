"""Idle targets and their consumers: when a target nobody pulls from goes to zero pods, when it wakes, and who
pulls from it (status.idle, status.consumers).

Pure, like the rest of the package: the reconciler passes the spec, the wake annotation, the stored status
and what each endpoint's /readyz said about its data requests (observation.ActivityReport), and renders the
Deployment with no pods once `idle` is stored. The idle clock survives an operator restart: the servers keep
their own last request, the stored status keeps its coarse copy (for when no server is left to ask) and the
time the target last became Available (a target nobody has pulled from yet is idle counted from then).

A target goes idle only on evidence taken after its deadline (last request + window): every endpoint's
report must have been asked for at or after it and show no newer request. Until then the judgement asks
for fresh reports (the reconciler has the prober ask at once) instead of deciding on old ones; an endpoint
whose activity is unknown (not probed yet, its probes timing out) keeps the target awake. Servers report
ages on their own monotonic clock, placed on the operator's clock when heard, so no clock skew between nodes
shrinks the window.

Going idle is recorded in status.idle with the wake annotation's value at that moment; any other value of
the annotation (resolve() writes the time) wakes the target. Comparing values, not times, makes a wake
immune to clock skew between the caller and the operator.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from eagle3_target.protocol import CONSUMER_WINDOW_SECONDS, IDLE_SINCE, IDLE_WAKE_RECORDED, wake_requested

from eagle3_operator.spec import Eagle3TargetSpec
from eagle3_operator.status import reasons
from eagle3_operator.status.observation import ActivityReport, parse_timestamp, timestamp

# status.consumers.lastRequestAt moves in steps of this fraction of the idle window (between the bounds), so
# a target in use is written now and then, not on every request (the servers keep the exact time; status's
# copy only matters once no server remembers).
LAST_REQUEST_STEP_FRACTION = 1 / 20
MIN_LAST_REQUEST_STEP_S = 30.0
MAX_LAST_REQUEST_STEP_S = 300.0
MAX_LISTED_CONSUMERS = 10


@dataclass(frozen=True)
class IdleJudgement:
    """status.idle (None: awake) and status.consumers; in how many seconds time alone may change them (None:
    only a change of what is observed can); and, when the deadline has passed but some report is older
    than it, that deadline: every endpoint must be asked again (at or after it) before the target may idle."""

    idle: dict[str, Any] | None
    consumers: dict[str, Any]
    recheck_in: float | None
    reports_wanted_after: datetime | None = None


def judge_idle(
    spec: Eagle3TargetSpec,
    wake: str | None,
    previous: Mapping[str, Any],
    reports: Sequence[ActivityReport | None],
    now: datetime,
) -> IdleJudgement:
    """Whether the target is idle now, and its consumers. `reports`: one per endpoint whose activity counts
    (None where it is unknown: not probed yet, probes timing out, or a server that does not say)."""
    after = spec.idle.after_seconds
    step = _last_request_step(after)
    known = [report for report in reports if report is not None]
    consumers, consumers_recheck = _consumers(known, previous.get("consumers") or {}, step, now)
    stored = previous.get("idle")
    if after is None or spec.suspend or spec.external:
        return IdleJudgement(None, consumers, consumers_recheck)
    if stored:
        awake = wake_requested(wake, stored)
        return IdleJudgement(None if awake else dict(stored), consumers, consumers_recheck)
    if None in reports:  # some endpoint's activity is unknown: it keeps the target awake
        return IdleJudgement(None, consumers, consumers_recheck)
    deadline = _deadline(previous, known, consumers, after, now)
    if deadline is None:
        return IdleJudgement(None, consumers, consumers_recheck)
    if now < deadline:
        return IdleJudgement(None, consumers, _earliest((deadline - now).total_seconds(), consumers_recheck))
    if all(report.asked_at >= deadline for report in known):
        idle = {IDLE_SINCE: timestamp(now), IDLE_WAKE_RECORDED: wake}
        return IdleJudgement(idle, consumers, consumers_recheck)
    return IdleJudgement(None, consumers, consumers_recheck, reports_wanted_after=deadline)


def wake_pending_since(wake: str | None, status: Mapping[str, Any]) -> datetime | None:
    """When a wake that has not come true yet was asked for: the time in the wake annotation, while the
    (computed) status says the target is not Available and has not been since before that time (it went
    idle, was woken, and has not served since, however it fails meanwhile). None otherwise: Available,
    suspended, no wake since it last served, or an annotation that holds no time (resolve() writes one)."""
    available = _condition(status, reasons.AVAILABLE)
    if available.get("status") == "True" or status.get("phase") == "Suspended" or not wake:
        return None
    try:
        requested = datetime.fromisoformat(wake)
    except ValueError:
        return None
    requested = requested if requested.tzinfo else requested.replace(tzinfo=UTC)
    unavailable_since = parse_timestamp(available.get("lastTransitionTime"))
    if unavailable_since is None or requested < unavailable_since:
        return None
    return requested


def idle_message(spec: Eagle3TargetSpec) -> str:
    return f"no data requests for {spec.idle.scale_to_zero_after}; resolve() wakes it"


def _deadline(
    previous: Mapping[str, Any],
    reports: Sequence[ActivityReport],
    consumers: Mapping[str, Any],
    after: int,
    now: datetime,
) -> datetime | None:
    """When the target is idle unless a newer request shows up: a window after its last data request or
    after it last became Available, whichever is later. None while it cannot go idle: not serving (loading,
    downloading, failing) or still rolling out or downloading a new revision. A request in flight puts the
    deadline a window from now."""
    available = _condition(previous, reasons.AVAILABLE)
    serving_since = parse_timestamp(available.get("lastTransitionTime"))
    if available.get("status") != "True" or serving_since is None or not reports:
        return None
    if _condition(previous, reasons.PROGRESSING).get("status") == "True":
        return None
    window = timedelta(seconds=after)
    if any(report.activity.in_flight for report in reports):
        return now + window
    stored_last = parse_timestamp(consumers.get("lastRequestAt"))
    moments = [serving_since, *([stored_last] if stored_last else []), *_last_requests(reports)]
    return max(moments) + window


def _consumers(
    reports: Sequence[ActivityReport], stored: Mapping[str, Any], step: float, now: datetime
) -> tuple[dict[str, Any], float | None]:
    """status.consumers from the servers' activity, and when it next changes by time alone: a client leaves
    the window, or (while clients are active) the stored last request may be a step behind. Servers that
    list no ids (a target with auth answers the operator with counts only) still count."""
    since = now - timedelta(seconds=CONSUMER_WINDOW_SECONDS)
    clients: dict[str, datetime] = {}
    for report in reports:
        for client in report.activity.clients:
            last_seen = report.client_last(client)
            if last_seen >= since:
                clients[client.id] = max(last_seen, clients.get(client.id, last_seen))
    active = max([len(clients), *(report.activity.active_clients for report in reports)])
    last = stored.get("lastRequestAt")
    live = max(_last_requests(reports), default=None)
    if live is not None:
        live = live.replace(microsecond=0)  # to the second, as status keeps it
        stored_last = parse_timestamp(last)
        if stored_last is None or (live - stored_last).total_seconds() >= step:
            last = timestamp(live)
    consumers = {
        "active": active,
        "windowSeconds": CONSUMER_WINDOW_SECONDS,
        "lastRequestAt": last,
        "clients": sorted(clients)[:MAX_LISTED_CONSUMERS],
    }
    if not active:
        return consumers, None
    leaves = (min(clients.values()) - since).total_seconds() if clients else step
    return consumers, max(min(leaves, step), MIN_LAST_REQUEST_STEP_S)


def _last_requests(reports: Sequence[ActivityReport]) -> list[datetime]:
    """The last data request of each server that has had one."""
    return [last for report in reports if (last := report.last_request) is not None]


def _last_request_step(after: int | None) -> float:
    if after is None:
        return MAX_LAST_REQUEST_STEP_S
    return min(max(after * LAST_REQUEST_STEP_FRACTION, MIN_LAST_REQUEST_STEP_S), MAX_LAST_REQUEST_STEP_S)


def _condition(status: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), {})


def _earliest(*delays: float | None) -> float | None:
    given = [delay for delay in delays if delay is not None]
    return min(given) if given else None
