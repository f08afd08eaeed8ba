"""What Kubernetes and Prometheus call: liveness, readiness and metrics. None of them needs a token."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from fastapi.routing import APIRoute

from eagle3_target.server.deps import StateDep, TargetDep

router = APIRouter()


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(state: StateDep, _target: TargetDep) -> dict[str, object]:
    """Ready, and who has pulled lately (what the operator reads to tell a used target from an idle one)."""
    return {"status": "ready", "activity": state.activity.snapshot().model_dump(mode="json", by_alias=True)}


@router.get("/metrics")
async def metrics(state: StateDep) -> Response:
    body, content_type = state.metrics.exposition()
    return Response(body, media_type=content_type)


# The probes' paths, for what must always let them through (auth, the connection cap).
PROBE_PATHS = frozenset(route.path for route in router.routes if isinstance(route, APIRoute))
