"""The idle rules without a cluster: when a served target goes to zero pods, what keeps it awake, what wakes
it, and how its consumers are counted and written without churn."""

from datetime import timedelta
from typing import Any

import pytest
from eagle3_operator.render.deployment import build_deployment
from eagle3_operator.render.names import owner_reference
from eagle3_operator.status.document import compute_status, status_patch
from eagle3_operator.status.idle import MAX_LISTED_CONSUMERS, judge_idle
from eagle3_target.protocol import CONSUMER_WINDOW_SECONDS, Activity, ClientActivity

from support.observations import T0, make_spec, observe
from support.targets import condition

WINDOW = "60s"


def served(since: Any = T0, **extra: Any) -> dict[str, Any]:
    """A stored status of a target Available since `since` (and not progressing)."""
    stamp = since.strftime("%Y-%m-%dT%H:%M:%SZ")
    conditions = [
        {"type": "Available", "status": "True", "reason": "Serving", "lastTransitionTime": stamp},
        {"type": "Progressing", "status": "False", "reason": "AllReplicasReady", "lastTransitionTime": stamp},
    ]
    return {"conditions": conditions, **extra}


def activity(*clients: tuple[str, Any], in_flight: int = 0) -> Activity:
    listed = tuple(ClientActivity(id=c, requests=1, last_request_at=at.timestamp()) for c, at in clients)
    last = max((at.timestamp() for _, at in clients), default=None)
    return Activity(requests=len(listed), last_request_at=last, in_flight=in_flight, clients=listed)


def spec(**overrides: Any):
    return make_spec(idle={"scaleToZeroAfter": WINDOW}, **overrides)


def at(seconds: float):
    return T0 + timedelta(seconds=seconds)


def test_a_target_nobody_pulls_from_goes_idle_a_window_after_it_became_available():
    before = judge_idle(spec(), None, served(), [Activity(), Activity()], at(59))
    assert before.idle is None and before.recheck_in == pytest.approx(1)
    after = judge_idle(spec(), None, served(), [Activity(), Activity()], at(60))
    assert after.idle == {"since": "2026-11-30T03:01:00Z", "wakeRequestedAt": None}


def test_the_window_counts_from_the_last_request_of_any_replica():
    used = [activity(("a", at(10))), activity(("b", at(40)))]
    assert judge_idle(spec(), None, served(), used, at(99)).recheck_in == pytest.approx(1)
    assert judge_idle(spec(), None, served(), used, at(100)).idle is not None


def test_the_stored_last_request_counts_when_no_server_remembers_it():
    """After the servers restarted (or a restart of the operator found new pods), status keeps the clock."""
    stored = served(consumers={"lastRequestAt": "2026-11-30T03:00:30Z"})
    assert judge_idle(spec(), None, stored, [Activity()], at(89)).idle is None
    assert judge_idle(spec(), None, stored, [Activity()], at(90)).idle is not None


@pytest.mark.parametrize(
    ("why", "previous", "activities"),
    [
        ("a request in flight", served(), [activity(("a", at(0)), in_flight=1)]),
        ("a server that does not say", served(), [Activity(), None]),
        ("no server serving", served(), []),
        ("not available", {"conditions": [{"type": "Available", "status": "False"}]}, [Activity()]),
        (
            "rolling out or downloading",
            {"conditions": [*served()["conditions"][:1], {"type": "Progressing", "status": "True"}]},
            [Activity()],
        ),
    ],
)
def test_what_keeps_a_target_awake(why, previous, activities):
    assert judge_idle(spec(), None, previous, activities, at(3600)).idle is None, why


def test_no_idle_window_or_a_suspended_target_never_goes_idle():
    assert judge_idle(make_spec(), None, served(), [Activity()], at(86400)).idle is None
    assert judge_idle(spec(suspend=True), None, served(), [Activity()], at(86400)).idle is None


def test_an_idle_target_stays_idle_until_its_wake_annotation_changes():
    stored = served(idle={"since": "2026-11-30T03:01:00Z", "wakeRequestedAt": "t1"})
    assert judge_idle(spec(), "t1", stored, [], at(7200)).idle == stored["idle"]
    assert judge_idle(spec(), "t2", stored, [], at(7200)).idle is None
    assert judge_idle(spec(), None, stored, [], at(7200)).idle is None  # removed: a new value too
    never_woken = served(idle={"since": "2026-11-30T03:01:00Z"})
    assert judge_idle(spec(), None, never_woken, [], at(7200)).idle is not None
    assert judge_idle(make_spec(), None, never_woken, [], at(7200)).idle is None  # spec.idle removed


def test_consumers_are_distinct_clients_of_every_replica_within_the_window():
    replicas = [
        activity(("job-a/1", at(100)), ("job-b/2", at(200))),
        activity(("job-a/1", at(300)), ("old/3", at(0))),
    ]
    now = at(CONSUMER_WINDOW_SECONDS + 50)  # old/3 left the window
    judged = judge_idle(make_spec(), None, {}, replicas, now)
    assert judged.consumers == {
        "active": 2,
        "windowSeconds": CONSUMER_WINDOW_SECONDS,
        "lastRequestAt": "2026-11-30T03:05:00Z",
        "clients": ["job-a/1", "job-b/2"],
    }
    assert judged.recheck_in == pytest.approx(150)  # job-b/2 leaves first (job-a/1 pulled again at 300 s)
    many = [activity(*((f"c{n:02}", at(0)) for n in range(MAX_LISTED_CONSUMERS + 5)))]
    listed = judge_idle(make_spec(), None, {}, many, at(1)).consumers
    assert listed["active"] == MAX_LISTED_CONSUMERS + 5 and len(listed["clients"]) == MAX_LISTED_CONSUMERS


def test_the_last_request_is_written_in_steps_so_a_target_in_use_is_not_rewritten_per_request():
    stored = {"consumers": {"lastRequestAt": "2026-11-30T03:00:00Z"}}
    step = 60 / 20  # a twentieth of the window
    close = judge_idle(spec(), None, stored, [activity(("a", at(step - 1)))], at(step))
    assert close.consumers["lastRequestAt"] == "2026-11-30T03:00:00Z"
    moved = judge_idle(spec(), None, stored, [activity(("a", at(step)))], at(step))
    assert moved.consumers["lastRequestAt"] == "2026-11-30T03:00:03Z"


def test_an_idle_target_reads_idle_and_its_deployment_asks_for_no_pods():
    idle = {"since": "2026-11-30T03:01:00Z"}
    status = compute_status(observe(spec(), idle=idle, pods=(), probes={}), served(), at(61))
    for kind in ("Ready", "Available"):
        assert (condition(status, kind)["status"], condition(status, kind)["reason"]) == ("False", "Idle")
    assert "no data requests for 60s; resolve() wakes it" in condition(status, "Ready")["message"]
    assert (status["phase"], status["readyDesired"], status["idle"]) == ("Idle", "0/0", idle)
    deployment = build_deployment("t", "ns", spec(replicas=3), owner_reference("t", "uid"), idle=True)
    assert deployment["spec"]["replicas"] == 0


def test_consumers_in_status_change_only_when_the_count_or_a_step_moves():
    consumers = {"active": 1, "windowSeconds": 600, "lastRequestAt": "2026-11-30T03:00:00Z", "clients": ["a"]}
    first = compute_status(observe(consumers=consumers), {}, T0)
    assert first["consumers"] == consumers
    assert status_patch(first, compute_status(observe(consumers=dict(consumers)), first, T0)) == {}
