"""The FastAPI app: the routers (probes, native API, NeMo compatibility), error handlers and middleware."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from eagle3_target.server.auth import BearerAuthMiddleware, TokenFile
from eagle3_target.server.errors import install_error_handlers
from eagle3_target.server.request_tracking import RequestTrackingMiddleware
from eagle3_target.server.routes import native, nemo, probes
from eagle3_target.server.service import SupervisionService
from eagle3_target.server.settings import ServerSettings
from eagle3_target.server.state import ServerState


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: ServerState = app.state.server
    state.start_loading()
    yield
    state.close()


def create_app(settings: ServerSettings) -> FastAPI:
    """Build the app. Starting it only starts the model load on a background thread, so the socket
    listens (and /healthz answers, /readyz says 503) while the weights load. TokenFileError when
    `--auth-token-file` holds no token."""
    state = ServerState(settings)
    app = FastAPI(title="eagle3-target", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.state.supervision = SupervisionService(state)
    install_error_handlers(app)
    if settings.auth_token_file is not None:
        app.add_middleware(BearerAuthMiddleware, tokens=TokenFile(settings.auth_token_file))
    app.add_middleware(RequestTrackingMiddleware, metrics=state.metrics)
    for routes in (probes, native, nemo):
        app.include_router(routes.router)
    return app
