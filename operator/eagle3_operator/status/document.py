"""The status document as the operator stores it: every key it owns, nulls dropped (the API server stores
none), the last failure kept after recovery, and the merge patch that writes only what changed (RFC 7386: a
member it does not name is kept, so every member that disappears, at any depth, is named with a null).

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
    return _merge_patch(
        {key: previous.get(key) for key in STATUS_KEYS}, {key: new.get(key) for key in STATUS_KEYS}
    )


def _merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """What turns `old` into `new` under a merge patch: changed members, maps recursively, and a null for
    each member `new` lacks (lists are replaced whole)."""
    patch: dict[str, Any] = {}
    for key in old.keys() | new.keys():
        before, after = old.get(key), new.get(key)
        if before == after:
            continue
        if isinstance(before, Mapping) and isinstance(after, Mapping):
            patch[key] = _merge_patch(before, after)
        else:
            patch[key] = after
    return patch


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
