"""Errors the training-side client raises, one class per thing a caller would handle differently."""


class ClientError(RuntimeError):
    """Base class of every error raised by `eagle3_target.client`."""


class ResolveError(ClientError):
    """Resolving an `Eagle3Target` by name failed."""


class TargetNotFound(ResolveError):
    """The `Eagle3Target` resource does not exist (or was deleted while waiting)."""


class TargetCRDMissing(ResolveError):
    """The cluster does not serve the `Eagle3Target` API at all: the CRD is not installed."""


class TargetAccessForbidden(ResolveError):
    """The credentials in use may not read `Eagle3Target` resources in that namespace."""


class ResolveTimeout(ResolveError):
    """The resource did not meet the requirement (Available, or Ready) for its current generation within
    the wait budget."""


class TargetUnavailable(ClientError):
    """No endpoint answered a request after every retry (connection errors, 429 or 503 throughout)."""


class RequestRejected(ClientError):
    """The server answered an error other than 429 and 503 (bad input, an engine fault): not retried."""

    def __init__(self, status_code: int, error_type: str, message: str) -> None:
        super().__init__(f"HTTP {status_code} {error_type}: {message}")
        self.status_code = status_code
        self.error_type = error_type
        self.message = message


class FingerprintChanged(ClientError):
    """The target's fingerprint differs from the run's first one (other model, layers or weights)."""

    def __init__(self, expected: str, got: str, endpoint: str) -> None:
        super().__init__(
            f"target fingerprint changed mid-run: started with {expected!r}, {endpoint} now serves {got!r} "
            "(pass allow_fingerprint_change=True to accept a different target)"
        )
        self.expected = expected
        self.got = got
        self.endpoint = endpoint
