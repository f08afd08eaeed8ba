"""What status is computed from: the typed record of one target's objects and server probes at one moment.

The reconciler fills these from its caches and probes; everything else in the package reads only them,
which is why status needs no cluster to test. Also the small shared vocabulary: a failure (reason and
message) and the most actionable of several (reasons.FAILURE_PRIORITY), timestamps as the API writes
them, and the address of a server at a pod IP.
"""

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from eagle3_target.protocol import Activity, ClientActivity, ServedModel

from eagle3_operator.spec import Eagle3TargetSpec
from eagle3_operator.status.reasons import FAILURE_PRIORITY

EPOCH = datetime.fromtimestamp(0, UTC)


@dataclass(frozen=True)
class Failure:
    reason: str
    message: str


def most_actionable(failures: Iterable[Failure]) -> Failure | None:
    """The failure an operator of the cluster should fix first (FAILURE_PRIORITY order), if any."""
    return min(failures, key=lambda f: FAILURE_PRIORITY.index(f.reason), default=None)


@dataclass(frozen=True)
class PodView:
    """The parts of a target pod that status needs; small, because one is kept in memory per pod."""

    name: str
    ip: str | None
    node: str | None
    ready: bool  # the pod's own Ready condition (kubelet probes)
    terminating: bool
    created: datetime | None
    started: datetime | None  # when the server container last started running (the startup budget's start)
    failure: Failure | None  # a failure readable from the pod alone (not time-based)
    progress: str | None = None  # what a pod that does not serve yet is doing, as far as the pod says
    identity: tuple[str, ...] = ()  # render.server_command.model_identity of the pod's server command
    hydration: bool = False  # a pod of the hydration Job, not a server pod
    finished: bool = False  # phase Succeeded or Failed: it will never run again


@dataclass(frozen=True)
class JobView:
    """The hydration Job's outcome so far."""

    name: str
    complete: bool
    failure: Failure | None  # the Job gave up (backoff limit, or a download that cannot succeed)


@dataclass(frozen=True)
class Hydration:
    """A huggingFace source's download into its cache claim, as status reports it."""

    source: str  # repo@revision into claim, for messages
    complete: bool
    failure: Failure | None = None
    progress: str | None = None  # files and bytes done, when the running download says


@dataclass(frozen=True)
class DeploymentView:
    generation: int
    observed_generation: int
    desired: int  # .spec.replicas
    replicas: int
    ready_replicas: int
    updated_replicas: int
    failure: Failure | None  # ReplicaFailure or ProgressDeadlineExceeded from its conditions


# A probe's error before its first verdict, in the prober's placeholder and so in status messages (the scale
# bench waits until no status says it).
NOT_PROBED_YET = "not probed yet"


@dataclass(frozen=True)
class ActivityReport:
    """What one serving endpoint's /readyz said of its data requests, placed on the operator's clock: the
    server measured its ages at some moment between `asked_at` and `answered_at`. The idle clock decides on
    these alone, so both stamps lean the safe way: a request is as late as it can have been (answered_at
    minus its age), and the report is only as fresh as the moment it was asked for."""

    activity: Activity
    asked_at: datetime
    answered_at: datetime

    @property
    def last_request(self) -> datetime | None:
        """The latest moment its last data request can have started or ended; None: it has had none."""
        idle = self.activity.idle_seconds
        return None if idle is None else self._before_answer(idle)

    def client_last(self, client: ClientActivity) -> datetime:
        return self._before_answer(client.idle_seconds)

    def _before_answer(self, age: float) -> datetime:
        """An age the server measured, placed on the operator's clock as late as it can be."""
        return self.answered_at - timedelta(seconds=age)


@dataclass(frozen=True)
class ProbeResult:
    """One server's answer: ready means /readyz said 200 and /v1/info parsed; else `error` says why."""

    ready: bool
    info: ServedModel | None = None  # what /v1/info reported, as status.model publishes it
    error: str | None = None
    reachable: bool = True
    progress: str | None = None  # a loading server's own account of its load (the message of its 503)
    timed_out: bool = False  # the probe ran out of time (the prober then keeps the endpoint apart)
    # What a ready server's /readyz said about its data requests (None: it did not say). Not compared: a
    # new request is no new verdict (the prober asks for a pass when the number of active clients or the
    # set of listed ones changes).
    activity: ActivityReport | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Observation:
    """Everything known about one target at one moment."""

    generation: int
    spec: Eagle3TargetSpec | None
    spec_error: str | None = None
    url: str | None = None
    selector: str | None = None
    deployment: DeploymentView | None = None
    pods: Sequence[PodView] = ()
    probes: Mapping[str, ProbeResult] = field(default_factory=dict)  # by pod name, or the URL when external
    hydration: Hydration | None = None  # only for huggingFace sources
    identity: tuple[str, ...] = ()  # render.server_command.model_identity of the current spec's command
    apply_failure: Failure | None = None  # the API server refused to apply a child (or one is not ours)
    awaiting_download: bool = False  # a running download's progress has not been polled yet
    idle: Mapping[str, Any] | None = None  # status.idle: scaled to zero for idleness (status/idle.py)
    consumers: Mapping[str, Any] | None = None  # status.consumers (status/idle.py)

    @property
    def awaiting_verdicts(self) -> bool:
        """Whether an endpoint has had no probe verdict yet (the operator just started, or a pod just got
        its IP), or a running download no poll yet: what it serves, or how far it is, is unknown, not
        failed or absent."""
        return self.awaiting_download or any(probe.error == NOT_PROBED_YET for probe in self.probes.values())


def timestamp(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_timestamp(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def endpoint_address(ip: str, port: int) -> str:
    """The base URL of a server at a pod IP (IPv6 addresses in brackets, as URLs need them)."""
    host = f"[{ip}]" if ipaddress.ip_address(ip).version == 6 else ip
    return f"http://{host}:{port}"
