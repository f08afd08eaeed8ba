"""Every reason the operator writes on a target's conditions, and the condition types each can appear on.

One home, so docs, alerts and tests can list them without reading the rules: `REASONS` maps each reason to
its condition types, and tests/eagle3_operator/status/test_reasons.py fails when the package passes a
condition a reason that is not here. Failures (`FAILURE_PRIORITY`) set Ready, Progressing and Degraded (and
Available, unless some endpoint still serves the current model); the other reasons describe a state that
needs no human.
"""

READY = "Ready"
AVAILABLE = "Available"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"

# The API server refused to apply a child (child_applier.apply_failure), or a child's name is taken.
NAME_CONFLICT = "NameConflict"
ADMISSION_DENIED = "AdmissionDenied"
QUOTA_EXCEEDED = "QuotaExceeded"
FORBIDDEN = "Forbidden"
CONFLICT = "Conflict"
APPLY_FAILED = "ApplyFailed"
INVALID_SPEC = "InvalidSpec"
# What pods, containers, the download Job and the Deployment say (status/observe.py).
UNSCHEDULABLE = "Unschedulable"
IMAGE_PULL_BACK_OFF = "ImagePullBackOff"  # also the kubelet's ErrImagePull and InvalidImageName
CREATE_CONTAINER_CONFIG_ERROR = "CreateContainerConfigError"
CREATE_CONTAINER_ERROR = "CreateContainerError"
MODEL_DOWNLOAD_FAILED = "ModelDownloadFailed"
MODEL_LOAD_FAILED = "ModelLoadFailed"
ENGINE_FAILED = "EngineFailed"
OOM_KILLED = "OOMKilled"
CRASH_LOOP_BACK_OFF = "CrashLoopBackOff"
REPLICA_FAILURE = "ReplicaFailure"
STARTUP_TIMEOUT = "StartupTimeout"
PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"
# What the operator's own probes say (status/state.py).
ENDPOINT_UNREACHABLE = "EndpointUnreachable"
FINGERPRINT_MISMATCH = "FingerprintMismatch"

# When several things fail differently, the reason reported is the first in this order (most actionable).
FAILURE_PRIORITY = (
    NAME_CONFLICT,
    ADMISSION_DENIED,
    QUOTA_EXCEEDED,
    FORBIDDEN,
    CONFLICT,
    APPLY_FAILED,
    INVALID_SPEC,
    UNSCHEDULABLE,
    IMAGE_PULL_BACK_OFF,
    CREATE_CONTAINER_CONFIG_ERROR,
    CREATE_CONTAINER_ERROR,
    MODEL_DOWNLOAD_FAILED,
    MODEL_LOAD_FAILED,
    ENGINE_FAILED,
    OOM_KILLED,
    CRASH_LOOP_BACK_OFF,
    REPLICA_FAILURE,
    STARTUP_TIMEOUT,
    PROGRESS_DEADLINE_EXCEEDED,
    ENDPOINT_UNREACHABLE,
    FINGERPRINT_MISMATCH,
)

# States that need no human.
ALL_REPLICAS_READY = "AllReplicasReady"  # every desired replica serves the current model
SERVING = "Serving"  # Available: at least one endpoint serves the current model
ENDPOINT_READY = "EndpointReady"  # an external target's URL answers ready
ENDPOINT_NOT_READY = "EndpointNotReady"  # an external target's URL answers but is not ready yet
LOADING = "Loading"
ROLLING_OUT = "RollingOut"
DOWNLOADING = "Downloading"  # the hydration Job is filling the cache claim
SCALED_TO_ZERO = "ScaledToZero"  # spec.replicas is 0
SUSPENDED = "Suspended"
SUSPENDING = "Suspending"  # suspended, pods still stopping
IDLE = "Idle"  # scaled to zero pods for idleness (status/idle.py)
AS_EXPECTED = "AsExpected"  # Degraded=False: nothing is failing

_SETTLED_OR_MOVING = frozenset({READY, AVAILABLE, PROGRESSING})
REASONS: dict[str, frozenset[str]] = {
    **{reason: frozenset({READY, AVAILABLE, PROGRESSING, DEGRADED}) for reason in FAILURE_PRIORITY},
    ALL_REPLICAS_READY: frozenset({READY, PROGRESSING}),
    SERVING: frozenset({AVAILABLE}),
    ENDPOINT_READY: _SETTLED_OR_MOVING,
    ENDPOINT_NOT_READY: frozenset({READY, AVAILABLE}),
    LOADING: _SETTLED_OR_MOVING,
    ROLLING_OUT: _SETTLED_OR_MOVING,
    DOWNLOADING: _SETTLED_OR_MOVING,
    SCALED_TO_ZERO: _SETTLED_OR_MOVING,
    SUSPENDED: _SETTLED_OR_MOVING,
    SUSPENDING: frozenset({PROGRESSING}),
    IDLE: _SETTLED_OR_MOVING,
    AS_EXPECTED: frozenset({DEGRADED}),
}
