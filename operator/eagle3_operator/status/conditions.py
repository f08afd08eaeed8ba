"""Conditions: the state of each one (status, reason, message), its stored form with a transition time that
moves only when its status does, and the events worth announcing when one changes.

Users read conditions (`kubectl wait`, `resolve(require=...)`) rather than the phase, so what makes a
transition time move or an event fire is decided here, in one place.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from eagle3_operator.status import reasons
from eagle3_operator.status.observation import Failure, timestamp
from eagle3_operator.status.reasons import AVAILABLE, DEGRADED, FAILURE_PRIORITY, PROGRESSING, READY

CONDITION_TYPES = (READY, AVAILABLE, PROGRESSING, DEGRADED)


class Condition(NamedTuple):
    """One condition's state; its type is the key it is kept under, its time is stamped when stored."""

    status: str  # True | False
    reason: str
    message: str


# The Degraded condition of every state that is not a failure.
NOT_DEGRADED = Condition("False", reasons.AS_EXPECTED, "nothing is failing")


@dataclass(frozen=True)
class Transition:
    """A change worth a Kubernetes event."""

    type: str  # Normal | Warning
    reason: str
    message: str


def failed(failure: Failure) -> dict[str, Condition]:
    return {
        "Ready": Condition("False", failure.reason, failure.message),
        "Progressing": Condition("False", failure.reason, failure.message),
        "Degraded": Condition("True", failure.reason, failure.message),
    }


def quiet(ready: str, reason: str, message: str) -> dict[str, Condition]:
    """Conditions for a settled state: nothing progressing, nothing degraded."""
    return {
        "Ready": Condition(ready, reason, message),
        "Progressing": Condition("False", reason, message),
        "Degraded": NOT_DEGRADED,
    }


def stored_condition(
    kind: str, condition: Condition, generation: int, previous: Mapping[str, Any], now: datetime
) -> dict[str, Any]:
    """The condition as status.conditions holds it; its transition time is kept unless its status moved."""
    old: Mapping[str, Any] = next((c for c in previous.get("conditions") or [] if c.get("type") == kind), {})
    moved = old.get("status") != condition.status or not old.get("lastTransitionTime")
    return {
        "type": kind,
        "status": condition.status,
        "reason": condition.reason,
        "message": condition.message,
        "lastTransitionTime": timestamp(now) if moved else old["lastTransitionTime"],
        "observedGeneration": generation,
    }


def transitions(previous: Mapping[str, Any], new: Mapping[str, Any]) -> list[Transition]:
    """Events for conditions whose status or reason changed: Warning for failures, Normal otherwise.

    Available is announced only when it says something Ready's own event does not: not when Ready moved to
    the same status in the same transition.
    """
    before = {c["type"]: c for c in previous.get("conditions") or [] if "type" in c}
    after = {c["type"]: c for c in new.get("conditions") or []}
    ready_moved_to = (after.get("Ready") or {}).get("status")
    if (before.get("Ready") or {}).get("status") == ready_moved_to:
        ready_moved_to = None
    events: list[Transition] = []
    for condition in new.get("conditions") or []:
        if any(event.reason == condition["reason"] for event in events):
            continue
        old = before.get(condition["type"], {})
        if (old.get("status"), old.get("reason")) == (condition["status"], condition["reason"]):
            continue
        if condition["type"] == "Available" and condition["status"] == ready_moved_to:
            continue
        if not old and condition["type"] != "Ready" and condition["status"] == "False":
            continue  # A new target that is not progressing or degraded: nothing worth an event.
        failing = condition["type"] == "Degraded" and condition["status"] == "True"
        failing |= condition["type"] in ("Ready", "Available") and condition["reason"] in FAILURE_PRIORITY
        message = f"{condition['type']}={condition['status']}: {condition['message']}"
        events.append(Transition("Warning" if failing else "Normal", condition["reason"], message))
    return events
