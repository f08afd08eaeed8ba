"""The native API: the served model's identity, supervision in every format, vocab mappings, weights."""

from __future__ import annotations

import re

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from eagle3_target.contract import VocabMapping
from eagle3_target.protocol import WEIGHT_NAMES, TargetInfo, TransportName
from eagle3_target.server.batching import Tensors
from eagle3_target.server.body import read_body_capped
from eagle3_target.server.computations import held_weight
from eagle3_target.server.deps import AnswerDep, Counted, ServiceDep, StateDep, TargetDep
from eagle3_target.server.refusals import Invalid, Malformed, Unknown
from eagle3_target.server.service import SupervisionQuery
from eagle3_target.server.settings import mapping_body_limit
from eagle3_target.server.state import disconnected
from eagle3_target.server.streaming import PayloadResponse
from eagle3_target.wire import tensors as tensor_wire

_MAPPING_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")

router = APIRouter()


def decode_safetensors(body: bytearray) -> Tensors:
    """Request tensors from a safetensors body; 400 when it is not one."""
    try:
        tensors, _metadata = tensor_wire.decode(body)
    except ValueError as exc:
        raise Malformed(f"body is not a valid safetensors buffer: {exc}") from exc
    return tensors


@router.get("/v1/info", response_model=TargetInfo)
async def info(target: TargetDep) -> TargetInfo:
    return target.info


@router.post("/v1/supervision", dependencies=[Counted])
async def supervision(
    request: Request,
    state: StateDep,
    service: ServiceDep,
    target: TargetDep,
    answer: AnswerDep,
    format: str = "hidden",
    vocab: str | None = None,
    dtype: str | None = None,
    layers: str | None = None,
    final: str | None = None,
) -> Response:
    plan = service.plan(target, SupervisionQuery(format, vocab, dtype, layers, final))
    body = await read_body_capped(request, state.settings.token_body_limit)
    answer_ = await service.supervise(
        target, plan, lambda: decode_safetensors(body), answer, lambda: disconnected(request)
    )
    payload = await run_in_threadpool(tensor_wire.encode_payload, answer_.tensors, answer_.metadata)
    service.delivered(answer_, payload.nbytes, TransportName.HTTP)
    return PayloadResponse(payload)


@router.put("/v1/vocab-mappings/{mapping_id}")
async def put_vocab_mapping(
    mapping_id: str, request: Request, state: StateDep, target: TargetDep
) -> JSONResponse:
    if not _MAPPING_ID.match(mapping_id):
        raise Invalid("vocab mapping ids are 1-128 characters of [A-Za-z0-9._-]")
    body = await read_body_capped(request, mapping_body_limit(target.info.vocab_size))

    def build() -> VocabMapping:
        """Validated (and its digest taken) on the host, then moved to the target's device once."""
        tensors = decode_safetensors(body)
        if set(tensors) != {"selected_token_ids"}:
            raise Invalid(f"expected exactly one tensor 'selected_token_ids', got {sorted(tensors)}")
        ids = tensors["selected_token_ids"]
        if ids.dtype != torch.int64:
            raise Invalid(f"selected_token_ids must be int64, got {ids.dtype}")
        try:
            return VocabMapping.from_selected_ids(ids, target.info.vocab_size).to(target.device)
        except ValueError as exc:
            raise Invalid(str(exc)) from exc

    mapping = await run_in_threadpool(build)
    state.mappings.put(mapping_id, mapping)
    return JSONResponse(
        {"id": mapping_id, "draft_vocab_size": mapping.draft_vocab_size, "digest": mapping.digest()}
    )


@router.get("/v1/weights/{name}", dependencies=[Counted])
async def weights(name: str, state: StateDep, answer: AnswerDep) -> Response:
    if name not in WEIGHT_NAMES:
        raise Unknown(f"unknown weight {name!r}; expected one of {list(WEIGHT_NAMES)}")
    target = state.require_target()  # after the name check: an unknown weight is 404 even while loading
    weight = await held_weight(target, name, answer)
    metadata = {"name": name, "fingerprint": target.info.fingerprint}
    return PayloadResponse(await run_in_threadpool(tensor_wire.encode_payload, {"weight": weight}, metadata))
