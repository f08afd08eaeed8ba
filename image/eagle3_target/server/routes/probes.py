"""What Kubernetes and Prometheus call: liveness, readiness and metrics. None of them needs a token."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from eagle3_target.server.deps import StateDep, TargetDep

# Set by the auth middleware on the probes' requests of a target with auth: whether the caller sent the token.
AUTHENTICATED = "authenticated"

router = APIRouter()


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request, state: StateDep, _target: TargetDep) -> dict[str, object]:
    """Ready, and how much it was pulled from lately (what the operator reads to tell a used target from an
    idle one); who pulled only for a caller that may know (AUTHENTICATED)."""
    identities = getattr(request.state, AUTHENTICATED, True)  # no auth: every caller may
    activity = state.activity.snapshot(identities=identities)
    return {"status": "ready", "activity": activity.model_dump(mode="json", by_alias=True)}


@router.get("/metrics")
async def metrics(state: StateDep) -> Response:
    body, content_type = state.metrics.exposition()
    return Response(body, media_type=content_type)


# The probes' paths, for what must always let them through (auth, the connection cap).
PROBE_PATHS = frozenset(route.path for route in router.routes if isinstance(route, APIRoute))
