"""What routes ask FastAPI for: the server's state, and the loaded target (503 until the model is loaded)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from eagle3_target.server.state import ServerState
from eagle3_target.server.target import LoadedTarget


async def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


StateDep = Annotated[ServerState, Depends(server_state)]


async def loaded_target(state: StateDep) -> LoadedTarget:
    return state.require_target()


TargetDep = Annotated[LoadedTarget, Depends(loaded_target)]
