"""Idle targets and their consumers: when a target nobody pulls from goes to zero pods, when it wakes, and who
pulls from it (status.idle, status.consumers).

Pure, like the rest of the package: the reconciler passes the spec, the wake annotation, the stored status
and what the serving endpoints' /readyz said about their data requests (protocol.Activity), and renders the
Deployment with no pods while `idle` is set. The idle clock survives an operator restart: the servers keep
their own last request, the stored status keeps its coarse copy (for when no server is left to ask) and the
time the target last became Available (a target nobody has pulled from yet is idle counted from then).

Going idle is recorded in status.idle with the wake annotation's value at that moment; any other value of
the annotation (resolve() writes the time) wakes the target. Comparing values, not times, makes a wake
immune to clock skew between the caller and the operator.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from eagle3_target.protocol import CONSUMER_WINDOW_SECONDS, Activity

from eagle3_operator.spec import Eagle3TargetSpec
from eagle3_operator.status.observation import parse_timestamp, timestamp

# status.consumers.lastRequestAt moves in steps of this fraction of the idle window (between the bounds), so
# a target in use is written now and then, not on every request.
LAST_REQUEST_STEP_FRACTION = 1 / 20
MIN_LAST_REQUEST_STEP_S = 1.0
MAX_LAST_REQUEST_STEP_S = 300.0
MAX_LISTED_CONSUMERS = 10


@dataclass(frozen=True)
class IdleJudgement:
    """status.idle (None: awake) and status.consumers, and in how many seconds time alone may change them
    (None: only a change of what is observed can)."""

    idle: dict[str, Any] | None
    consumers: dict[str, Any]
    recheck_in: float | None


def judge_idle(
    spec: Eagle3TargetSpec,
    wake: str | None,
    previous: Mapping[str, Any],
    activities: Sequence[Activity | None],
    now: datetime,
) -> IdleJudgement:
    """Whether the target is idle now, and its consumers. `activities`: one per endpoint that serves (None
    where the server did not say: an older server, which keeps its target awake)."""
    after = spec.idle.after_seconds
    step = _last_request_step(after)
    known = [activity for activity in activities if activity is not None]
    consumers, consumers_recheck = _consumers(known, previous.get("consumers") or {}, step, now)
    stored = previous.get("idle")
    if after is None or spec.suspend or spec.external:
        return IdleJudgement(None, consumers, consumers_recheck)
    if stored:
        awake = wake != stored.get("wakeRequestedAt")
        return IdleJudgement(None if awake else dict(stored), consumers, consumers_recheck)
    recheck = _idle_in(previous, activities, consumers, after, now)
    if recheck is not None and recheck <= 0:
        idle = {"since": timestamp(now), "wakeRequestedAt": wake}
        return IdleJudgement(idle, consumers, consumers_recheck)
    return IdleJudgement(None, consumers, _earliest(recheck, consumers_recheck))


def idle_message(spec: Eagle3TargetSpec) -> str:
    return f"no data requests for {spec.idle.scale_to_zero_after}; resolve() wakes it"


def _idle_in(
    previous: Mapping[str, Any],
    activities: Sequence[Activity | None],
    consumers: Mapping[str, Any],
    after: int,
    now: datetime,
) -> float | None:
    """Seconds until the target is idle (<= 0: it is), counting from its last data request or from when it
    last became Available, whichever is later; None while it cannot go idle: not serving (loading,
    downloading, failing), still rolling out or downloading a new revision, or some server's activity
    unknown. A request in flight restarts the count."""
    available = _condition(previous, "Available")
    serving_since = parse_timestamp(available.get("lastTransitionTime"))
    if available.get("status") != "True" or serving_since is None or not activities:
        return None
    if _condition(previous, "Progressing").get("status") == "True" or None in activities:
        return None
    if any(activity is not None and activity.in_flight for activity in activities):
        return float(after)
    last = parse_timestamp(consumers.get("lastRequestAt"))
    base = max(serving_since, last) if last is not None else serving_since
    live = _live_last(a for a in activities if a is not None)
    if live is not None:
        base = max(base, live)
    return (base + timedelta(seconds=after) - now).total_seconds()


def _consumers(
    activities: Sequence[Activity], stored: Mapping[str, Any], step: float, now: datetime
) -> tuple[dict[str, Any], float | None]:
    """status.consumers from the servers' activity, and when it next changes by time alone: a client leaves
    the window, or (while clients are active) the stored last request may be a step behind."""
    since = now.timestamp() - CONSUMER_WINDOW_SECONDS
    clients: dict[str, float] = {}
    for activity in activities:
        for client in activity.clients:
            if client.last_request_at >= since:
                clients[client.id] = max(client.last_request_at, clients.get(client.id, 0.0))
    last = stored.get("lastRequestAt")
    live = _live_last(activities)
    if live is not None:
        stored_last = parse_timestamp(last)
        if stored_last is None or (live - stored_last).total_seconds() >= step:
            last = timestamp(live)
    consumers = {
        "active": len(clients),
        "windowSeconds": CONSUMER_WINDOW_SECONDS,
        "lastRequestAt": last,
        "clients": sorted(clients)[:MAX_LISTED_CONSUMERS],
    }
    if not clients:
        return consumers, None
    leaves = min(clients.values()) + CONSUMER_WINDOW_SECONDS - now.timestamp()
    return consumers, max(min(leaves, step), MIN_LAST_REQUEST_STEP_S)


def _live_last(activities: Any) -> datetime | None:
    """The last data request any of these servers saw (to the second, as status keeps it)."""
    moments = [activity.last_request_at for activity in activities if activity.last_request_at is not None]
    if not moments:
        return None
    return datetime.fromtimestamp(int(max(moments)), UTC)


def _last_request_step(after: int | None) -> float:
    if after is None:
        return MAX_LAST_REQUEST_STEP_S
    return min(max(after * LAST_REQUEST_STEP_FRACTION, MIN_LAST_REQUEST_STEP_S), MAX_LAST_REQUEST_STEP_S)


def _condition(status: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), {})


def _earliest(*delays: float | None) -> float | None:
    given = [delay for delay in delays if delay is not None]
    return min(given) if given else None
