"""What routes ask FastAPI for: the server's state, the supervision service, the loaded target (503 until the
model is loaded), for data routes, the count of the request in the server's activity (activity.py), and for
routes that answer tensors, the hold on memory their answer takes (streaming.AnswerMemory)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request

from eagle3_target.server.activity import client_of
from eagle3_target.server.service import SupervisionService
from eagle3_target.server.state import ServerState
from eagle3_target.server.streaming import AnswerHold
from eagle3_target.server.target import LoadedTarget


async def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


StateDep = Annotated[ServerState, Depends(server_state)]


async def loaded_target(state: StateDep) -> LoadedTarget:
    return state.require_target()


TargetDep = Annotated[LoadedTarget, Depends(loaded_target)]


async def supervision_service(request: Request) -> SupervisionService:
    service: SupervisionService = request.app.state.supervision
    return service


ServiceDep = Annotated[SupervisionService, Depends(supervision_service)]


async def counted(request: Request, state: StateDep) -> AsyncIterator[None]:
    """A data request: counted for its client and in flight while it is handled (what tells a used target
    from an idle one)."""
    with state.activity.request(client_of(request.headers, request.client.host if request.client else None)):
        yield


# For the routes whose requests are data requests (dependencies=[Counted]).
Counted = Depends(counted)


async def answer_memory(state: StateDep) -> AsyncIterator[AnswerHold]:
    """The bytes this request's answer holds, given back when the request ends: after the answer's last byte
    is sent, or once its connection is gone."""
    with state.answers.request() as hold:
        yield hold


AnswerDep = Annotated[AnswerHold, Depends(answer_memory)]
