"""NeMo AutoModel's remote-target protocol, so its ``remote`` backend trains against this server unchanged.

Routes and bodies follow NeMo 0.7.0's ``RemoteEagle3TargetModel``: JSON for control, its little-endian
tensor wire format for data. Differences that NeMo's client does not observe: errors are JSON 4xx instead
of bare 500s, ``/health`` is 503 until the model is ready (NeMo's server only listens once loaded),
``/init_nccl`` is disabled (NeMo then stays on the wire path), ``/disconnect`` never stops the server
(others may be training against it), and vocab mappings are kept per connection (see vocab_store).
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from eagle3_target.contract import VocabMapping
from eagle3_target.protocol import TransportName
from eagle3_target.server.batching import Tensors
from eagle3_target.server.body import read_body_capped
from eagle3_target.server.computations import held_weight
from eagle3_target.server.deps import AnswerDep, Counted, ServiceDep, StateDep, TargetDep
from eagle3_target.server.refusals import Invalid, Malformed, Unknown
from eagle3_target.server.settings import mapping_body_limit
from eagle3_target.server.state import disconnected
from eagle3_target.server.streaming import PayloadResponse
from eagle3_target.server.vocab_store import UnboundConnection
from eagle3_target.wire import nemo as nemo_wire

log = logging.getLogger(__name__)

router = APIRouter()

OK = {"status": "ok"}


def decode_nemo_wire(body: bytearray, limit: int) -> Tensors:
    """Tensors from a NeMo wire body; 400 when malformed, 422 when an entry is None."""
    try:
        tensors = nemo_wire.decode(body, max_total_bytes=limit)
    except ValueError as exc:
        raise Malformed(f"body is not a valid NeMo wire buffer: {exc}") from exc
    nones = sorted(name for name, tensor in tensors.items() if tensor is None)
    if nones:
        raise Invalid(f"tensors {nones} are None")
    return {name: tensor for name, tensor in tensors.items() if tensor is not None}


def peer(request: Request) -> tuple[str, int]:
    client = request.client
    return (client.host, client.port) if client else ("unknown", 0)


# Headers an HTTP proxy adds on the way (Envoy, as in Istio, adds its x-envoy-* ones).
PROXY_HEADERS = ("forwarded", "via", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto")


def own_connection(request: Request) -> tuple[str, int]:
    """The NeMo client's connection, which its vocab mapping is bound to. Behind an L7 proxy the peer is
    the proxy, which reuses its connections for any client (two trainers would share one mapping), so a
    proxied request is refused rather than answered with someone else's vocabulary."""
    proxied = [name for name in request.headers if name in PROXY_HEADERS or name.startswith("x-envoy-")]
    if proxied:
        raise Malformed(
            f"NeMo vocab mappings are bound to the client's own connection, and this request came through"
            f" an HTTP proxy ({', '.join(sorted(proxied))}), which shares connections between clients:"
            " reach the server directly (its pod IP or a headless Service, outside any mesh sidecar), or"
            " use the native client (PUT /v1/vocab-mappings/{id})"
        )
    return peer(request)


@router.get("/health")
async def health(_target: TargetDep) -> dict[str, str]:
    return OK


@router.post("/model_info")
async def model_info(target: TargetDep) -> dict[str, object]:
    return target.info.model_dump(
        mode="json", include={"num_hidden_layers", "hidden_size", "vocab_size", "aux_layer_ids"}
    )


@router.post("/input_embeddings", dependencies=[Counted])
async def input_embeddings(target: TargetDep, answer: AnswerDep) -> Response:
    weight = await held_weight(target, "input_embeddings", answer)
    return PayloadResponse(await run_in_threadpool(nemo_wire.encode_payload, {"weight": weight}))


@router.post("/set_vocab_mapping")
async def set_vocab_mapping(request: Request, state: StateDep, target: TargetDep) -> dict[str, str]:
    host, port = own_connection(request)
    limit = mapping_body_limit(target.info.vocab_size)
    body = await read_body_capped(request, limit)

    def build() -> VocabMapping:
        """Validated (and its digest taken) on the host, then moved to the target's device once."""
        tensors = decode_nemo_wire(body, limit)
        missing = {"selected_token_ids", "selected_token_mask"} - set(tensors)
        if missing:
            raise Invalid(f"missing tensors {sorted(missing)}")
        mask = tensors["selected_token_mask"]
        if mask.numel() != target.info.vocab_size:
            vocab = target.info.vocab_size
            raise Invalid(f"selected_token_mask has {mask.numel()} entries, target vocab {vocab}")
        try:
            return VocabMapping(tensors["selected_token_ids"], mask).to(target.device)
        except ValueError as exc:
            raise Invalid(str(exc)) from exc

    mapping = await run_in_threadpool(build)
    mapping_id = mapping.digest()
    state.mappings.put(mapping_id, mapping)
    state.nemo_bindings.bind(host, port, mapping_id)
    log.info("vocab mapping set", extra={"vocab": mapping_id, "peer": f"{host}:{port}"})
    return {**OK, "vocab_id": mapping_id}


@router.post("/generate", dependencies=[Counted])
async def generate(
    request: Request, state: StateDep, service: ServiceDep, target: TargetDep, answer: AnswerDep
) -> Response:
    try:
        mapping_id = state.nemo_bindings.resolve(*own_connection(request))
    except UnboundConnection as exc:
        raise Unknown(str(exc)) from exc
    plan = service.nemo_plan(target, mapping_id)
    limit = state.settings.token_body_limit
    body = await read_body_capped(request, limit)
    answer_ = await service.supervise(
        target, plan, lambda: decode_nemo_wire(body, limit), answer, lambda: disconnected(request)
    )
    payload = await run_in_threadpool(nemo_wire.encode_payload, answer_.tensors)
    service.delivered(answer_, payload.nbytes, TransportName.HTTP)
    return PayloadResponse(payload)


@router.post("/heartbeat")
async def heartbeat() -> dict[str, str]:
    return OK


@router.post("/init_nccl")
async def init_nccl() -> dict[str, str]:
    return {"status": "disabled"}


@router.post("/disconnect")
async def disconnect(request: Request) -> dict[str, str]:
    host, port = peer(request)
    log.info("client disconnected; the server keeps serving", extra={"peer": f"{host}:{port}"})
    return OK
