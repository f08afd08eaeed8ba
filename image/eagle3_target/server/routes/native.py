"""The native API: the served model's identity, supervision in every format, vocab mappings, weights."""

from __future__ import annotations

import json
import re

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from eagle3_target.contract import VocabMapping
from eagle3_target.protocol import FORMATS, LOGITS_DTYPES, WEIGHT_NAMES, TargetInfo
from eagle3_target.server.batching import EngineJob, Tensors
from eagle3_target.server.body import read_body_capped
from eagle3_target.server.computations import held_weight, supervision_answer_bytes, supervision_compute
from eagle3_target.server.deps import AnswerDep, Counted, StateDep, TargetDep
from eagle3_target.server.errors import BadRequest, NotFound, Unprocessable
from eagle3_target.server.settings import mapping_body_limit
from eagle3_target.server.streaming import PayloadResponse
from eagle3_target.server.validation import validate_token_batch
from eagle3_target.wire import tensors as tensor_wire

_MAPPING_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")

router = APIRouter()


def decode_safetensors(body: bytearray) -> Tensors:
    """Request tensors from a safetensors body; 400 when it is not one."""
    try:
        tensors, _metadata = tensor_wire.decode(body)
    except ValueError as exc:
        raise BadRequest(f"body is not a valid safetensors buffer: {exc}") from exc
    return tensors


@router.get("/v1/info", response_model=TargetInfo)
async def info(target: TargetDep) -> TargetInfo:
    return target.info


@router.post("/v1/supervision", dependencies=[Counted])
async def supervision(
    request: Request,
    state: StateDep,
    target: TargetDep,
    answer: AnswerDep,
    format: str = "hidden",
    vocab: str | None = None,
    dtype: str | None = None,
) -> Response:
    spec = FORMATS.get(format)
    if spec is None:
        raise Unprocessable(f"unknown format {format!r}; expected one of {list(FORMATS)}")
    if dtype is not None and dtype not in LOGITS_DTYPES:
        raise Unprocessable(f"unknown dtype {dtype!r}; expected one of {list(LOGITS_DTYPES)}")
    if dtype is not None and not spec.takes_dtype:
        dtype_formats = [name for name, each in FORMATS.items() if each.takes_dtype]
        raise Unprocessable(f"dtype applies to formats {dtype_formats} only, not {format!r}")
    if spec.needs_vocab and vocab is None:
        raise Unprocessable(f"format {format!r} needs a draft vocabulary: pass vocab=<mapping id>")
    mapping = None
    if vocab is not None:
        mapping = state.mappings.get(vocab)
        if mapping is None:
            raise NotFound(f"unknown vocab mapping {vocab!r}: PUT /v1/vocab-mappings/{vocab} first")
    body = await read_body_capped(request, state.settings.token_body_limit)
    inputs = await run_in_threadpool(
        lambda: validate_token_batch(
            decode_safetensors(body),
            required=("input_ids",),
            optional=("attention_mask",),
            vocab_size=target.info.vocab_size,
            max_model_len=target.info.max_model_len,
            max_batch_tokens=state.settings.max_batch_tokens,
        )
    )
    logits_dtype = getattr(torch, dtype or LOGITS_DTYPES[0])
    tokens = inputs["input_ids"].numel()
    answer_bytes = supervision_answer_bytes(target, format, tokens, mapping, logits_dtype)
    answer.take_answer(answer_bytes, tokens)
    job = EngineJob(
        batch_key=("supervision", format, logits_dtype, mapping.digest() if mapping else None),
        inputs=inputs,
        compute=supervision_compute(target, format, logits_dtype, mapping),
    )
    outputs = await state.run_on_engine(job, request)
    metadata = {
        "format": format,
        "fingerprint": target.info.fingerprint,
        "aux_layer_ids": json.dumps(target.info.aux_layer_ids),
    }
    if vocab is not None:
        metadata["vocab"] = vocab
    payload = await run_in_threadpool(tensor_wire.encode_payload, outputs, metadata)
    state.metrics.count_response(format, tokens=job.tokens, size=payload.nbytes)
    return PayloadResponse(payload)


@router.put("/v1/vocab-mappings/{mapping_id}")
async def put_vocab_mapping(
    mapping_id: str, request: Request, state: StateDep, target: TargetDep
) -> JSONResponse:
    if not _MAPPING_ID.match(mapping_id):
        raise Unprocessable("vocab mapping ids are 1-128 characters of [A-Za-z0-9._-]")
    body = await read_body_capped(request, mapping_body_limit(target.info.vocab_size))

    def build() -> VocabMapping:
        """Validated (and its digest taken) on the host, then moved to the target's device once."""
        tensors = decode_safetensors(body)
        if set(tensors) != {"selected_token_ids"}:
            raise Unprocessable(f"expected exactly one tensor 'selected_token_ids', got {sorted(tensors)}")
        ids = tensors["selected_token_ids"]
        if ids.dtype != torch.int64:
            raise Unprocessable(f"selected_token_ids must be int64, got {ids.dtype}")
        try:
            return VocabMapping.from_selected_ids(ids, target.info.vocab_size).to(target.device)
        except ValueError as exc:
            raise Unprocessable(str(exc)) from exc

    mapping = await run_in_threadpool(build)
    state.mappings.put(mapping_id, mapping)
    return JSONResponse(
        {"id": mapping_id, "draft_vocab_size": mapping.draft_vocab_size, "digest": mapping.digest()}
    )


@router.get("/v1/weights/{name}", dependencies=[Counted])
async def weights(name: str, state: StateDep, answer: AnswerDep) -> Response:
    if name not in WEIGHT_NAMES:
        raise NotFound(f"unknown weight {name!r}; expected one of {list(WEIGHT_NAMES)}")
    target = state.require_target()  # after the name check: an unknown weight is 404 even while loading
    weight = await held_weight(target, name, answer)
    metadata = {"name": name, "fingerprint": target.info.fingerprint}
    return PayloadResponse(await run_in_threadpool(tensor_wire.encode_payload, {"weight": weight}, metadata))
