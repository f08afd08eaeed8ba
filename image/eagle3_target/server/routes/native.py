"""The native API: the served model's identity, supervision in every format, vocab mappings, weights."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from eagle3_target.contract import VocabMapping
from eagle3_target.protocol import (
    FORMATS,
    LAYERS_FORMAT,
    LOGITS_DTYPES,
    SERVED_FORMATS,
    WEIGHT_NAMES,
    LayerSelection,
    TargetInfo,
)
from eagle3_target.server.batching import EngineJob, Tensors
from eagle3_target.server.body import read_body_capped
from eagle3_target.server.computations import (
    held_weight,
    layers_answer_bytes,
    layers_compute,
    supervision_answer_bytes,
    supervision_compute,
)
from eagle3_target.server.deps import AnswerDep, Counted, StateDep, TargetDep
from eagle3_target.server.errors import BadRequest, NotFound, Unprocessable
from eagle3_target.server.settings import mapping_body_limit
from eagle3_target.server.state import ServerState
from eagle3_target.server.streaming import PayloadResponse
from eagle3_target.server.target import LoadedTarget
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
    layers: str | None = None,
    final: str | None = None,
) -> Response:
    if format == LAYERS_FORMAT:
        plan = _layers_plan(target, vocab, dtype, layers, final)
    else:
        plan = _format_plan(state, target, format, vocab, dtype, layers, final)
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
    tokens = inputs["input_ids"].numel()
    answer.take_answer(plan.answer_bytes(tokens), tokens)
    job = EngineJob(batch_key=plan.batch_key, inputs=inputs, compute=plan.compute)
    outputs = await state.run_on_engine(job, request)
    metadata = {
        "format": format,
        "fingerprint": target.info.fingerprint,
        "aux_layer_ids": json.dumps(target.info.aux_layer_ids),
        **plan.metadata,
    }
    payload = await run_in_threadpool(tensor_wire.encode_payload, outputs, metadata)
    state.metrics.count_response(format, tokens=job.tokens, size=payload.nbytes)
    return PayloadResponse(payload)


@dataclass(frozen=True)
class _Plan:
    """What a supervision request will compute, checked before its body is read: the engine batch it may
    join, its computation, its answer's size and the metadata beside the tensors."""

    batch_key: tuple[object, ...]
    compute: Callable[[Tensors], Tensors]
    answer_bytes: Callable[[int], int]
    metadata: dict[str, str]


def _format_plan(
    state: ServerState,
    target: LoadedTarget,
    format: str,
    vocab: str | None,
    dtype: str | None,
    layers: str | None,
    final: str | None,
) -> _Plan:
    """One of the EAGLE-3 formats."""
    spec = FORMATS.get(format)
    if spec is None:
        raise Unprocessable(f"unknown format {format!r}; expected one of {list(SERVED_FORMATS)}")
    if layers is not None or final is not None:
        raise Unprocessable(f"layers and final apply to format={LAYERS_FORMAT} only, not {format!r}")
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
    logits_dtype = getattr(torch, dtype or LOGITS_DTYPES[0])
    return _Plan(
        batch_key=("supervision", format, logits_dtype, mapping.digest() if mapping else None),
        compute=supervision_compute(target, format, logits_dtype, mapping),
        answer_bytes=lambda tokens: supervision_answer_bytes(target, format, tokens, mapping, logits_dtype),
        metadata={"vocab": vocab} if vocab is not None else {},
    )


def _layers_plan(
    target: LoadedTarget, vocab: str | None, dtype: str | None, layers: str | None, final: str | None
) -> _Plan:
    """The ``layers`` format: any captured layers and, if asked, the last hidden state."""
    if vocab is not None or dtype is not None:
        raise Unprocessable(f"format={LAYERS_FORMAT} ships hidden states only: it takes no vocab or dtype")
    try:
        selection = LayerSelection.parse(layers, final, target.info.captured_layers)
    except ValueError as exc:
        raise Unprocessable(str(exc)) from None
    return _Plan(
        # Requests batched together share one computation, so they must want the same tensors.
        batch_key=("supervision", LAYERS_FORMAT, selection),
        compute=layers_compute(target, selection),
        answer_bytes=lambda tokens: layers_answer_bytes(target, selection, tokens),
        metadata={
            "layers": json.dumps(list(selection.layers)),
            "final": selection.final,
            "capture_layer_ids": json.dumps(target.info.captured_layers),
        },
    )


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
