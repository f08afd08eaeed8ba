"""Names, labels and owner references that every child of a target shares.

Resource names may be DNS subdomains but Service names may not, and label values have their own limits, so
one place maps a target's name onto each and keeps the result stable and collision-resistant.
"""

import hashlib
import re
from typing import Any

from eagle3_target.protocol import API_VERSION, KIND

from eagle3_operator.constants import (
    APP_NAME,
    COMPONENT,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_NAME,
    MANAGED_LABELS,
)

NAME_LIMIT = 63
HASH_LENGTH = 8

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:HASH_LENGTH]


def fit_name(text: str, limit: int = NAME_LIMIT) -> str:
    """`text` if it is a DNS-1035 label within `limit`, else a readable prefix plus a hash of the whole.

    Resource names are DNS subdomains (dots, leading digits, up to 253 characters) but Service names are
    not, so a name that does not fit as is gets a deterministic, collision-resistant stand-in.
    """
    if len(text) <= limit and _DNS_LABEL.match(text):
        return text
    readable = re.sub(r"[^a-z0-9-]", "-", text.lower())
    if not readable[:1].isalpha():
        readable = f"e3t-{readable}"
    readable = readable[: limit - HASH_LENGTH - 1].rstrip("-")
    return f"{readable}-{short_hash(text)}"


def child_name(target_name: str) -> str:
    """The one name all of a target's children share (their kinds differ): the target's, when it fits."""
    return fit_name(target_name)


def instance_label(target_name: str) -> str:
    """The target's name as a label value: as is when it is one (dots allowed), else the child name."""
    return target_name if _LABEL_VALUE.match(target_name) else child_name(target_name)


def selector_labels(target_name: str) -> dict[str, str]:
    """Labels that pick a target's pods. Only the operator sets them: a Deployment's selector is immutable."""
    return {LABEL_NAME: APP_NAME, LABEL_INSTANCE: instance_label(target_name)}


def label_selector(target_name: str) -> str:
    """`selector_labels` as the string `status.selector` publishes (the scale subresource reads it)."""
    return ",".join(f"{key}={value}" for key, value in sorted(selector_labels(target_name).items()))


def child_labels(target_name: str) -> dict[str, str]:
    return {
        **selector_labels(target_name),
        LABEL_COMPONENT: COMPONENT,
        **MANAGED_LABELS,
    }


def owner_reference(target_name: str, uid: str) -> dict[str, Any]:
    """The controller reference every child carries, so deleting the target deletes them."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": target_name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(name: str, target_name: str, namespace: str, owner: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": child_labels(target_name),
        "ownerReferences": [dict(owner)],
    }
