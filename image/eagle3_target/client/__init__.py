"""Training-side client: resolve an `Eagle3Target` by name and pull supervision batches from its servers.

`TargetClient` loads lazily: it needs torch, and `eagle3-target resolve` should not wait for that.
"""

from typing import TYPE_CHECKING, Any

from eagle3_target.client.errors import (
    ClientError,
    FingerprintChanged,
    RequestRejected,
    ResolveError,
    ResolveTimeout,
    TargetAccessForbidden,
    TargetCRDMissing,
    TargetNotFound,
    TargetUnavailable,
)
from eagle3_target.client.prefetch import prefetch
from eagle3_target.client.resolve import ResolvedTarget, resolve

if TYPE_CHECKING:
    from eagle3_target.client.target_client import TargetClient

__all__ = [
    "ClientError",
    "FingerprintChanged",
    "RequestRejected",
    "ResolveError",
    "ResolveTimeout",
    "ResolvedTarget",
    "TargetAccessForbidden",
    "TargetCRDMissing",
    "TargetClient",
    "TargetNotFound",
    "TargetUnavailable",
    "prefetch",
    "resolve",
]


def __getattr__(name: str) -> Any:
    if name == "TargetClient":
        from eagle3_target.client.target_client import TargetClient

        return TargetClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
