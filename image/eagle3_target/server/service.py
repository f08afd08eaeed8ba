"""The supervision service: the one pipeline behind every door into the server.

A supervision request is planned (format, vocab, dtype and layers checked, the engine computation and the
answer's size known) before its body is read; then its token batch is decoded and validated, its answer's
bytes are held (413 or 503 before any compute), the engine job runs and the tensors come back on the host
with the metadata that travels beside them. How the answer leaves is the door's business: a safetensors or
NeMo wire body over HTTP, a send over a client's process group, or a put into a Mooncake store. Each door
then says what it delivered (`delivered`), so the metrics count every transport alike. Refusals are
`refusals.Refused`, in domain terms.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch
from starlette.concurrency import run_in_threadpool

from eagle3_target.contract import VocabMapping
from eagle3_target.protocol import FORMATS, LAYERS_FORMAT, LOGITS_DTYPES, SERVED_FORMATS, LayerSelection
from eagle3_target.server.batching import EngineJob, Tensors
from eagle3_target.server.computations import (
    layers_answer_bytes,
    layers_compute,
    nemo_answer_bytes,
    nemo_generate_compute,
    supervision_answer_bytes,
    supervision_compute,
)
from eagle3_target.server.refusals import Invalid, Unknown
from eagle3_target.server.state import ServerState
from eagle3_target.server.streaming import AnswerHold
from eagle3_target.server.target import LoadedTarget
from eagle3_target.server.validation import validate_token_batch

# The label NeMo's `/generate` answers are counted under, beside the native formats.
NEMO_LABEL = "nemo"


@dataclass(frozen=True)
class SupervisionQuery:
    """What a native supervision request asks for (its query parameters)."""

    format: str = "hidden"
    vocab: str | None = None
    dtype: str | None = None
    layers: str | None = None
    final: str | None = None


@dataclass(frozen=True)
class Plan:
    """What a supervision request will compute, checked before its body is read: the request tensors it
    takes, the engine batch it may join, its computation, its answer's size and the metadata beside the
    tensors. ``label`` names it in the metrics (a format, or "nemo")."""

    label: str
    required: tuple[str, ...]
    optional: tuple[str, ...]
    batch_key: tuple[object, ...]
    compute: Callable[[Tensors], Tensors]
    answer_bytes: Callable[[int], int]
    metadata: dict[str, str]


@dataclass(frozen=True)
class Supervision:
    """A computed answer on the host: its tensors (unshifted, or NeMo's shifted batch), the metadata that
    travels beside them, and how many tokens it covers."""

    label: str
    tensors: Tensors
    metadata: dict[str, str]
    tokens: int


class SupervisionService:
    """Plans and computes supervision for any door; see the module docstring."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def plan(self, target: LoadedTarget, query: SupervisionQuery) -> Plan:
        """The native formats' plan (``layers`` among them); `Invalid` or `Unknown` when the query does
        not fit this target."""
        if query.format == LAYERS_FORMAT:
            return self._layers_plan(target, query)
        return self._format_plan(target, query)

    def nemo_plan(self, target: LoadedTarget, mapping_id: str) -> Plan:
        """NeMo's ``/generate``: its HF backend's batch over the draft vocabulary ``mapping_id``."""
        mapping = self._mapping(mapping_id, f"vocab mapping {mapping_id} was evicted: set it again")
        return Plan(
            label=NEMO_LABEL,
            required=("input_ids", "attention_mask", "loss_mask"),
            optional=(),
            batch_key=(NEMO_LABEL, mapping_id),
            compute=nemo_generate_compute(target, mapping),
            answer_bytes=lambda tokens: nemo_answer_bytes(target, tokens, mapping),
            metadata={},
        )

    async def supervise(
        self,
        target: LoadedTarget,
        plan: Plan,
        decode: Callable[[], Tensors],
        answer: AnswerHold,
        gone: Callable[[], Awaitable[None]],
    ) -> Supervision:
        """Decode and validate the batch (``decode`` runs on a pool thread), hold its answer's bytes in
        ``answer``, and run it on the engine; ``gone()`` returns once the client has left (its job is then
        dropped, `ClientGone`)."""
        settings = self.state.settings

        def validated() -> Tensors:
            return validate_token_batch(
                decode(),
                required=plan.required,
                optional=plan.optional,
                vocab_size=target.info.vocab_size,
                max_model_len=target.info.max_model_len,
                max_batch_tokens=settings.max_batch_tokens,
            )

        inputs = await run_in_threadpool(validated)
        tokens = inputs["input_ids"].numel()
        answer.take_answer(plan.answer_bytes(tokens), tokens)
        job = EngineJob(batch_key=plan.batch_key, inputs=inputs, compute=plan.compute)
        outputs = await self.state.run_on_engine(job, gone)
        metadata = {"fingerprint": target.info.fingerprint, **plan.metadata}
        return Supervision(plan.label, outputs, metadata, job.tokens)

    def delivered(self, supervision: Supervision, nbytes: int, transport: str) -> None:
        """Count an answer that left over ``transport``: its tokens and bytes."""
        self.state.metrics.count_response(
            supervision.label, tokens=supervision.tokens, size=nbytes, transport=transport
        )

    def _mapping(self, mapping_id: str, missing: str) -> VocabMapping:
        mapping = self.state.mappings.get(mapping_id)
        if mapping is None:
            raise Unknown(missing)
        return mapping

    def _format_plan(self, target: LoadedTarget, query: SupervisionQuery) -> Plan:
        """One of the EAGLE-3 formats."""
        fmt, vocab, dtype = query.format, query.vocab, query.dtype
        spec = FORMATS.get(fmt)
        if spec is None:
            raise Invalid(f"unknown format {fmt!r}; expected one of {list(SERVED_FORMATS)}")
        if query.layers is not None or query.final is not None:
            raise Invalid(f"layers and final apply to format={LAYERS_FORMAT} only, not {fmt!r}")
        if dtype is not None and dtype not in LOGITS_DTYPES:
            raise Invalid(f"unknown dtype {dtype!r}; expected one of {list(LOGITS_DTYPES)}")
        if dtype is not None and not spec.takes_dtype:
            dtype_formats = [name for name, each in FORMATS.items() if each.takes_dtype]
            raise Invalid(f"dtype applies to formats {dtype_formats} only, not {fmt!r}")
        if spec.needs_vocab and vocab is None:
            raise Invalid(f"format {fmt!r} needs a draft vocabulary: pass vocab=<mapping id>")
        mapping = None
        if vocab is not None:
            mapping = self._mapping(
                vocab, f"unknown vocab mapping {vocab!r}: PUT /v1/vocab-mappings/{vocab} first"
            )
        logits_dtype = getattr(torch, dtype or LOGITS_DTYPES[0])
        return Plan(
            label=fmt,
            required=("input_ids",),
            optional=("attention_mask",),
            batch_key=("supervision", fmt, logits_dtype, mapping.digest() if mapping else None),
            compute=supervision_compute(target, fmt, logits_dtype, mapping),
            answer_bytes=lambda tokens: supervision_answer_bytes(target, fmt, tokens, mapping, logits_dtype),
            metadata=self._native_metadata(target, fmt) | ({"vocab": vocab} if vocab is not None else {}),
        )

    def _layers_plan(self, target: LoadedTarget, query: SupervisionQuery) -> Plan:
        """The ``layers`` format: any captured layers and, if asked, the last hidden state."""
        if query.vocab is not None or query.dtype is not None:
            raise Invalid(f"format={LAYERS_FORMAT} ships hidden states only: it takes no vocab or dtype")
        try:
            selection = LayerSelection.parse(query.layers, query.final, target.info.captured_layers)
        except ValueError as exc:
            raise Invalid(str(exc)) from None
        return Plan(
            label=LAYERS_FORMAT,
            required=("input_ids",),
            optional=("attention_mask",),
            # Requests batched together share one computation, so they must want the same tensors.
            batch_key=("supervision", LAYERS_FORMAT, selection),
            compute=layers_compute(target, selection),
            answer_bytes=lambda tokens: layers_answer_bytes(target, selection, tokens),
            metadata=self._native_metadata(target, LAYERS_FORMAT)
            | {
                "layers": json.dumps(list(selection.layers)),
                "final": selection.final,
                "capture_layer_ids": json.dumps(target.info.captured_layers),
            },
        )

    @staticmethod
    def _native_metadata(target: LoadedTarget, fmt: str) -> dict[str, str]:
        return {"format": fmt, "aux_layer_ids": json.dumps(target.info.aux_layer_ids)}
