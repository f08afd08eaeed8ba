"""The status document as the operator stores it: every key it owns, nulls dropped (the API server stores
none), the last failure kept after recovery, and the merge patch that writes only what changed.

An unchanged observation must give an empty patch, or an idle operator would write every target on every
probe; the keys listed here are the only ones the operator ever patches.
"""

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from eagle3_operator.status.conditions import CONDITION_TYPES, stored_condition
from eagle3_operator.status.observation import Failure, Observation, timestamp
from eagle3_operator.status.state import OBSERVED_KEYS, target_state

# The status keys the operator owns; anything else under .status is left alone.
STATUS_KEYS = ("observedGeneration", "phase", "conditions", *OBSERVED_KEYS, "lastFailure")


def compute_status(observation: Observation, previous: Mapping[str, Any], now: datetime) -> dict[str, Any]:
    """The full status (STATUS_KEYS only; None means "absent") for one observation."""
    state = target_state(observation, previous, now)
    judged = state.conditions | {"Available": state.available or state.conditions["Ready"]}
    conditions = [
        stored_condition(kind, judged[kind], observation.generation, previous, now)
        for kind in CONDITION_TYPES
    ]
    status = {key: None for key in STATUS_KEYS} | state.fields
    status["observedGeneration"] = observation.generation
    status["phase"] = state.phase
    status["conditions"] = conditions
    status["lastFailure"] = _last_failure(state.failure, previous.get("lastFailure"), now)
    return {key: _compact(value) for key, value in status.items()}


def status_patch(previous: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """A merge patch from the stored status to `new`; empty when nothing changed (then nothing is written)."""
    return {key: new.get(key) for key in STATUS_KEYS if previous.get(key) != new.get(key)}


def _compact(value: Any) -> Any:
    """Drop None members: the API server stores no nulls, so a stored status never contains them."""
    if isinstance(value, Mapping):
        return {k: _compact(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_compact(v) for v in value]
    return value


def _last_failure(failure: Failure | None, previous: Mapping[str, Any] | None, now: datetime) -> Any:
    """The most recent failure, kept after recovery; its time moves only when the reason changes."""
    if failure is None:
        return previous
    if previous and previous.get("reason") == failure.reason and previous.get("time"):
        return {"reason": failure.reason, "message": failure.message, "time": previous["time"]}
    return {"reason": failure.reason, "message": failure.message, "time": timestamp(now)}
