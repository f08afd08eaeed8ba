"""Training-side client: resolve an `Eagle3Target` by name and pull supervision batches from its servers."""

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
from eagle3_target.client.resolve import ModelInfo, ResolvedTarget, resolve
from eagle3_target.client.target_client import TargetClient

__all__ = [
    "ClientError",
    "FingerprintChanged",
    "ModelInfo",
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
