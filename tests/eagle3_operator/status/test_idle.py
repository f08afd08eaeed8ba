"""The idle rules without a cluster: when a served target goes to zero pods, what keeps it awake, what wakes
it, how its consumers are counted and written without churn, and since when a wake is pending."""

from datetime import datetime, timedelta
from typing import Any

import pytest
from eagle3_operator.render.deployment import build_deployment
from eagle3_operator.render.names import owner_reference
from eagle3_operator.settings import OperatorConfig
from eagle3_operator.status.document import compute_status, status_patch
from eagle3_operator.status.idle import (
    MAX_LISTED_CONSUMERS,
    MIN_LAST_REQUEST_STEP_S,
    judge_idle,
    wake_pending_since,
)
from eagle3_operator.status.observation import ActivityReport, Failure
from eagle3_target.protocol import CONSUMER_WINDOW_SECONDS, Activity, ClientActivity

from support.observations import T0, make_spec, observe
from support.targets import condition

WINDOW = "60s"
PROBE_PERIOD = OperatorConfig.reprobe_seconds  # the operator's default


def served(since: Any = T0, **extra: Any) -> dict[str, Any]:
    """A stored status of a target Available since `since` (and not progressing)."""
    stamp = since.strftime("%Y-%m-%dT%H:%M:%SZ")
    conditions = [
        {"type": "Available", "status": "True", "reason": "Serving", "lastTransitionTime": stamp},
        {"type": "Progressing", "status": "False", "reason": "AllReplicasReady", "lastTransitionTime": stamp},
    ]
    return {"conditions": conditions, **extra}


def report(*clients: tuple[str, datetime], heard: datetime, in_flight: int = 0) -> ActivityReport:
    """What a server asked and answering at `heard` says, its clients having last pulled at these times."""
    listed = tuple(
        ClientActivity(id=c, requests=1, idle_seconds=(heard - pulled).total_seconds())
        for c, pulled in clients
    )
    last = max((pulled for _, pulled in clients), default=None)
    activity = Activity(
        requests=len(listed),
        idle_seconds=None if last is None else (heard - last).total_seconds(),
        in_flight=in_flight,
        active_clients=len(listed),
        clients=listed,
    )
    return ActivityReport(activity, asked_at=heard, answered_at=heard)


def spec(**overrides: Any):
    return make_spec(idle={"scaleToZeroAfter": WINDOW}, **overrides)


def at(seconds: float):
    return T0 + timedelta(seconds=seconds)


def test_a_target_nobody_pulls_from_goes_idle_a_window_after_it_became_available():
    before = judge_idle(spec(), None, served(), [report(heard=at(59))] * 2, at(59))
    assert before.idle is None and before.recheck_in == pytest.approx(1)
    after = judge_idle(spec(), None, served(), [report(heard=at(60))] * 2, at(60))
    assert after.idle == {"since": "2026-11-30T03:01:00Z", "wakeRequestedAt": None}


def test_the_window_counts_from_the_last_request_of_any_replica():
    def used(heard: datetime) -> list[ActivityReport]:
        return [report(("a", at(10)), heard=heard), report(("b", at(40.5)), heard=heard)]

    assert judge_idle(spec(), None, served(), used(at(100)), at(100)).recheck_in == pytest.approx(0.5)
    assert judge_idle(spec(), None, served(), used(at(100.5)), at(100.5)).idle is not None


def test_idle_is_decided_only_on_reports_asked_for_after_the_deadline():
    """A report from before the deadline cannot show a request made since: the judgement asks for new ones
    (the reconciler has the prober ask at once) instead of going idle on it."""
    stale = [report(("a", at(30)), heard=at(85)), report(heard=at(95))]
    judged = judge_idle(spec(), None, served(), stale, at(95))
    assert judged.idle is None and judged.reports_wanted_after == at(90)
    answered = [report(("a", at(89)), heard=at(95)), report(heard=at(95))]  # a request the old one missed
    again = judge_idle(spec(), None, served(), answered, at(95))
    assert again.idle is None and again.reports_wanted_after is None and 0 < again.recheck_in <= 54
    fresh = [report(("a", at(30)), heard=at(95)), report(heard=at(95))]
    assert judge_idle(spec(), None, served(), fresh, at(95)).idle is not None


def test_a_report_is_only_as_fresh_as_when_it_was_asked_for():
    """The server measured its ages somewhere between the question and the answer."""
    slow = ActivityReport(Activity(), asked_at=at(59), answered_at=at(61))
    judged = judge_idle(spec(), None, served(), [slow], at(61))
    assert judged.idle is None and judged.reports_wanted_after == at(60)
    pulled = ActivityReport(Activity(idle_seconds=5.0), asked_at=at(10), answered_at=at(20))
    assert pulled.last_request == at(15)  # the latest its last request can have been


def test_the_stored_last_request_counts_when_no_server_remembers_it():
    """After the servers restarted (or a restart of the operator found new pods), status keeps the clock."""
    stored = served(consumers={"lastRequestAt": "2026-11-30T03:00:30Z"})
    assert judge_idle(spec(), None, stored, [report(heard=at(89))], at(89)).idle is None
    assert judge_idle(spec(), None, stored, [report(heard=at(90))], at(90)).idle is not None


@pytest.mark.parametrize(
    ("why", "previous", "reports"),
    [
        ("a request in flight", served(), [report(("a", at(0)), heard=at(3600), in_flight=1)]),
        ("an endpoint whose activity is unknown", served(), [report(heard=at(3600)), None]),
        ("no server serving", served(), []),
        (
            "not available",
            {"conditions": [{"type": "Available", "status": "False"}]},
            [report(heard=at(3600))],
        ),
        (
            "rolling out or downloading",
            {"conditions": [*served()["conditions"][:1], {"type": "Progressing", "status": "True"}]},
            [report(heard=at(3600))],
        ),
    ],
)
def test_what_keeps_a_target_awake(why, previous, reports):
    assert judge_idle(spec(), None, previous, reports, at(3600)).idle is None, why


def simulate(window: float, gap: float | None, *, horizon: float) -> float | None:
    """The idle clock against the prober's cadence, as the reconciler runs it: one pass pending at a time
    (the work queue keeps the earliest asked for), run when a recheck falls due or when asked-for reports
    have come in; probes every PROBE_PERIOD, and at once when reports are wanted. A client pulls every `gap`
    seconds (None: never). Returns when the target went idle (None: not within `horizon`)."""
    target = make_spec(idle={"scaleToZeroAfter": f"{window:g}s"})
    pulls = [] if gap is None else [1.0 + n * gap for n in range(int(horizon / gap) + 1)]

    def probe(t: float) -> ActivityReport:
        done = [at(p) for p in pulls if p <= t]
        return report(*([("trainer", done[-1])] if done else []), heard=at(t))

    status: dict[str, Any] = served()
    published, next_probe = probe(0.0), 3.0
    next_pass: float | None = 0.0
    asked = False
    while next_pass is not None and next_pass <= horizon:
        if next_probe < next_pass:  # a new request alone asks for no pass
            published, next_probe = probe(next_probe), next_probe + PROBE_PERIOD
            continue
        t = next_pass
        if asked:  # the probes asked for have answered
            published, asked = probe(t), False
        judged = judge_idle(target, None, status, [published], at(t))
        status = {**status, "consumers": judged.consumers}
        if judged.idle is not None:
            return t
        delays = [] if judged.recheck_in is None else [judged.recheck_in]
        if judged.reports_wanted_after is not None:
            asked = True
            delays.append(0.01)
        next_pass = t + min(delays) if delays else None
    return None


@pytest.mark.parametrize(("window", "gap"), [(5, 3), (8, 3), (30, 20), (30, 29), (60, 55), (600, 595)])
def test_a_client_pulling_more_often_than_the_window_is_never_cut_off(window, gap):
    """Review round 3, B1: deciding on reports up to a probe period old, each of these idled under it."""
    assert simulate(window, gap, horizon=max(600, 6 * window)) is None


@pytest.mark.parametrize("window", [5, 8, 30, 600])
def test_a_target_nobody_pulls_from_idles_within_a_window_and_a_probe_period(window):
    idled = simulate(window, None, horizon=10 * window)
    assert idled is not None and window <= idled <= window + PROBE_PERIOD


def test_no_idle_window_or_a_suspended_target_never_goes_idle():
    quiet = [report(heard=at(86400))]
    assert judge_idle(make_spec(), None, served(), quiet, at(86400)).idle is None
    assert judge_idle(spec(suspend=True), None, served(), quiet, at(86400)).idle is None


def test_an_idle_target_stays_idle_until_its_wake_annotation_changes():
    stored = served(idle={"since": "2026-11-30T03:01:00Z", "wakeRequestedAt": "t1"})
    assert judge_idle(spec(), "t1", stored, [], at(7200)).idle == stored["idle"]
    assert judge_idle(spec(), "t2", stored, [], at(7200)).idle is None
    assert judge_idle(spec(), None, stored, [], at(7200)).idle is None  # removed: a new value too
    never_woken = served(idle={"since": "2026-11-30T03:01:00Z"})
    assert judge_idle(spec(), None, never_woken, [], at(7200)).idle is not None
    assert judge_idle(make_spec(), None, never_woken, [], at(7200)).idle is None  # spec.idle removed


def test_consumers_are_distinct_clients_of_every_replica_within_the_window():
    now = at(CONSUMER_WINDOW_SECONDS + 50)  # old/3 left the window
    replicas = [
        report(("job-a/1", at(100)), ("job-b/2", at(200)), heard=now),
        report(("job-a/1", at(300)), ("old/3", at(0)), heard=now),
    ]
    judged = judge_idle(make_spec(), None, {}, replicas, now)
    assert judged.consumers == {
        "active": 2,
        "windowSeconds": CONSUMER_WINDOW_SECONDS,
        "lastRequestAt": "2026-11-30T03:05:00Z",
        "clients": ["job-a/1", "job-b/2"],
    }
    assert judged.recheck_in == pytest.approx(150)  # job-b/2 leaves first (job-a/1 pulled again at 300 s)
    many = [report(*((f"c{n:02}", at(0)) for n in range(MAX_LISTED_CONSUMERS + 5)), heard=at(1))]
    listed = judge_idle(make_spec(), None, {}, many, at(1)).consumers
    assert listed["active"] == MAX_LISTED_CONSUMERS + 5 and len(listed["clients"]) == MAX_LISTED_CONSUMERS


def test_servers_that_name_no_clients_still_count_them():
    """A target with auth shows the operator counts, not ids (its /readyz names clients to the token only)."""
    counted = ActivityReport(
        Activity(idle_seconds=1.0, active_clients=3), asked_at=at(10), answered_at=at(10)
    )
    consumers = judge_idle(make_spec(), None, {}, [counted], at(10)).consumers
    assert (consumers["active"], consumers["clients"], consumers["lastRequestAt"]) == (
        3,
        [],
        "2026-11-30T03:00:09Z",
    )


def test_the_last_request_is_written_in_steps_so_a_target_in_use_is_not_rewritten_per_request():
    stored = {"consumers": {"lastRequestAt": "2026-11-30T03:00:00Z"}}
    step = MIN_LAST_REQUEST_STEP_S  # a twentieth of a 60 s window is less: the floor holds
    close = judge_idle(spec(), None, stored, [report(("a", at(step - 1)), heard=at(step))], at(step))
    assert close.consumers["lastRequestAt"] == "2026-11-30T03:00:00Z"
    assert close.recheck_in is not None and close.recheck_in >= step - 1
    moved = judge_idle(spec(), None, stored, [report(("a", at(step)), heard=at(step))], at(step))
    assert moved.consumers["lastRequestAt"] == "2026-11-30T03:00:30Z"


def test_an_idle_target_reads_idle_and_its_deployment_asks_for_no_pods():
    idle = {"since": "2026-11-30T03:01:00Z"}
    status = compute_status(observe(spec(), idle=idle, pods=(), probes={}), served(), at(61))
    for kind in ("Ready", "Available"):
        assert (condition(status, kind)["status"], condition(status, kind)["reason"]) == ("False", "Idle")
    assert "no data requests for 60s; resolve() wakes it" in condition(status, "Ready")["message"]
    assert (status["phase"], status["readyDesired"], status["idle"]) == ("Idle", "0/0", idle)
    deployment = build_deployment("t", "ns", spec(replicas=3), owner_reference("t", "uid"), idle=True)
    assert deployment["spec"]["replicas"] == 0


def test_a_refused_scale_down_reads_as_a_failure_not_as_idle():
    """Review round 3, N1: the pods and their GPUs keep running when applying zero replicas is refused."""
    idle = {"since": "2026-11-30T03:01:00Z"}
    refused = Failure("AdmissionDenied", "admission webhook denied the request")
    status = compute_status(observe(spec(), idle=idle, apply_failure=refused), served(), at(61))
    assert status["phase"] == "Degraded" and status["idle"] == idle
    assert (condition(status, "Degraded")["status"], condition(status, "Degraded")["reason"]) == (
        "True",
        "AdmissionDenied",
    )
    assert condition(status, "Ready")["reason"] != "Idle"


def test_consumers_in_status_change_only_when_the_count_or_a_step_moves():
    consumers = {"active": 1, "windowSeconds": 600, "lastRequestAt": "2026-11-30T03:00:00Z", "clients": ["a"]}
    first = compute_status(observe(consumers=consumers), {}, T0)
    assert first["consumers"] == consumers
    assert status_patch(first, compute_status(observe(consumers=dict(consumers)), first, T0)) == {}


def unavailable(since: datetime, phase: str = "Failed") -> dict[str, Any]:
    """A computed status whose Available condition has been False since `since`."""
    stamp = since.strftime("%Y-%m-%dT%H:%M:%SZ")
    available = {"type": "Available", "status": "False", "reason": "Idle", "lastTransitionTime": stamp}
    return {"phase": phase, "conditions": [available]}


def test_a_wake_is_pending_from_its_request_until_the_target_is_available_again():
    went_idle, woken = T0, T0 + timedelta(minutes=30)
    assert wake_pending_since(woken.isoformat(), unavailable(went_idle)) == woken
    assert wake_pending_since(woken.isoformat().replace("+00:00", "Z"), unavailable(went_idle)) == woken
    # A time without a zone is the API's UTC.
    assert wake_pending_since(woken.replace(tzinfo=None).isoformat(), unavailable(went_idle)) == woken
    # The wake recorded when it went idle (older than that) is no wake; Available, suspended: none pending.
    assert wake_pending_since((went_idle - timedelta(hours=1)).isoformat(), unavailable(went_idle)) is None
    assert wake_pending_since(woken.isoformat(), served(went_idle)) is None
    assert wake_pending_since(woken.isoformat(), unavailable(went_idle, "Suspended")) is None
    # No annotation, or one that holds no time (kubectl annotate ... =now): nothing to count from.
    assert wake_pending_since(None, unavailable(went_idle)) is None
    assert wake_pending_since("please", unavailable(went_idle)) is None
