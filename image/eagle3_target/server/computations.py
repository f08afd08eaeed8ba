"""What the server computes from the loaded target for a request: the native supervision formats and NeMo's
`/generate` batch (run on the engine worker thread as an `EngineJob`'s computation), and the published
weights. The HTTP layer only validates, enqueues and encodes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from starlette.concurrency import run_in_threadpool
from torch import Tensor

from eagle3_target import formats
from eagle3_target.contract import VocabMapping, build_batch, select_layers
from eagle3_target.protocol import FORMATS, LAYERS_TENSOR, LayerSelection
from eagle3_target.runners.base import ForwardHiddenUnsupported
from eagle3_target.server.batching import Tensors
from eagle3_target.server.streaming import AnswerHold
from eagle3_target.server.target import LoadedTarget

# Room for an answer's framing (safetensors header, NeMo's per-entry framing) beside its tensors' data.
_FRAMING_BYTES = 4096


async def held_weight(target: LoadedTarget, name: str, answer: AnswerHold) -> Tensor:
    """One of `protocol.WEIGHT_NAMES` as the contiguous CPU tensor the wire formats encode. Its bytes are
    taken in ``answer`` from the weight where it lives, before the host copy (a full one, from a GPU) is
    made on a pool thread, so weight requests beyond the cap on answers in flight are refused uncopied."""
    getters = {
        "input_embeddings": target.runner.input_embedding_weight,
        "lm_head": target.runner.lm_head_weight,
        "final_norm": target.runner.final_norm_weight,
    }
    weight = getters[name]().detach()
    answer.take(weight.numel() * weight.element_size())
    return await run_in_threadpool(lambda: weight.cpu().contiguous())


def supervision_compute(
    target: LoadedTarget, fmt: str, logits_dtype: torch.dtype, mapping: VocabMapping | None
) -> Callable[[Tensors], Tensors]:
    """The native ``/v1/supervision`` computation for one format; outputs unshifted, on the target's device
    (the worker brings them to the host off the engine's path)."""

    def compute(inputs: Tensors) -> Tensors:
        input_ids = inputs["input_ids"].to(target.device)
        attention_mask = inputs["attention_mask"].to(target.device)
        final_hidden, captured = target.runner.forward_hidden(
            input_ids, attention_mask, prenorm=FORMATS[fmt].prenorm
        )
        return formats.supervision(
            fmt,
            final_hidden,
            aux_layers(target, captured),
            target.runner.lm_head_weight(),
            mapping=mapping,
            logits_dtype=logits_dtype,
        )

    return compute


def aux_layers(target: LoadedTarget, captured: Tensor) -> Tensor:
    """The EAGLE-3 aux layers [B,S,3H] among a runner's captured layers (the captured tensor itself when
    the target captures only them)."""
    return select_layers(captured, target.info.captured_layers, target.info.aux_layer_ids)


def layers_compute(target: LoadedTarget, selection: LayerSelection) -> Callable[[Tensors], Tensors]:
    """The ``layers`` format: the selected captured layers concatenated in the order asked, and the final
    state asked for (before or after the final norm), unshifted, on the target's device."""

    def compute(inputs: Tensors) -> Tensors:
        input_ids = inputs["input_ids"].to(target.device)
        attention_mask = inputs["attention_mask"].to(target.device)
        final_hidden, captured = target.runner.forward_hidden(
            input_ids, attention_mask, prenorm=selection.final != "postnorm"
        )
        out: Tensors = {}
        if selection.layers:
            out[LAYERS_TENSOR] = select_layers(captured, target.info.captured_layers, selection.layers)
        if selection.final_tensor is not None:
            out[selection.final_tensor] = final_hidden
        return out

    return compute


NEMO_SUPERVISION_KEYS = ("aux_hidden_states", "target_probs", "position_mask", "input_ids", "loss_mask")
# /generate ships the `probs` format's tensors plus the shifted int64 input ids and loss mask.
_NEMO_EXTRA_BYTES_PER_TOKEN = 8 + 8


def _token_sizes(
    target: LoadedTarget, mapping: VocabMapping | None, logits_dtype: torch.dtype
) -> formats.TokenSizes:
    info = target.info
    return formats.TokenSizes(
        hidden_size=info.hidden_size,
        vocab_size=info.vocab_size,
        draft_vocab_size=mapping.draft_vocab_size if mapping is not None else 0,
        model_itemsize=getattr(torch, info.dtype).itemsize,
        logits_itemsize=logits_dtype.itemsize,
    )


def supervision_answer_bytes(
    target: LoadedTarget, fmt: str, tokens: int, mapping: VocabMapping | None, logits_dtype: torch.dtype
) -> int:
    """The size of the ``/v1/supervision`` answer for ``tokens`` tokens, framing included (an upper bound)."""
    return tokens * formats.bytes_per_token(fmt, _token_sizes(target, mapping, logits_dtype)) + _FRAMING_BYTES


def layers_answer_bytes(target: LoadedTarget, selection: LayerSelection, tokens: int) -> int:
    """The size of a ``layers`` answer for ``tokens`` tokens, framing included (an upper bound)."""
    states = len(selection.layers) + (selection.final_tensor is not None)
    itemsize = getattr(torch, target.info.dtype).itemsize
    return tokens * states * target.info.hidden_size * itemsize + _FRAMING_BYTES


def nemo_answer_bytes(target: LoadedTarget, tokens: int, mapping: VocabMapping) -> int:
    """The size of NeMo's ``/generate`` answer for ``tokens`` tokens, framing included (an upper bound)."""
    per_token = formats.bytes_per_token("probs", _token_sizes(target, mapping, torch.float32))
    return tokens * (per_token + _NEMO_EXTRA_BYTES_PER_TOKEN) + _FRAMING_BYTES


def nemo_generate_compute(target: LoadedTarget, mapping: VocabMapping) -> Callable[[Tensors], Tensors]:
    """NeMo's ``/generate``: the draft-vocab batch of its HF backend, input ids and loss mask shifted.

    Full [B,S,V] logits exist one chunk of tokens at a time (the ``probs`` format, shifted afterwards), so
    peak memory stays near the [B,S,Vd] answer. Only a model whose head is not a plain GEMM (softcap,
    logit scale) takes the full-logits path.
    """

    def compute(inputs: Tensors) -> Tensors:
        input_ids = inputs["input_ids"].to(target.device)
        attention_mask = inputs["attention_mask"].to(target.device)
        loss_mask = inputs["loss_mask"].to(target.device)
        runner = target.runner
        try:
            final_hidden, captured = runner.forward_hidden(input_ids, attention_mask)
        except ForwardHiddenUnsupported:
            logits, captured = runner.forward_eagle3(input_ids, attention_mask)
            aux = aux_layers(target, captured)
            batch = build_batch(logits, aux, input_ids, attention_mask, loss_mask, mapping=mapping)
        else:
            aux = aux_layers(target, captured)
            probs = formats.supervision("probs", final_hidden, aux, runner.lm_head_weight(), mapping=mapping)
            batch = formats.batch_from_supervision(
                "probs", probs, input_ids, attention_mask, loss_mask, mapping=mapping
            )
        return {name: getattr(batch, name) for name in NEMO_SUPERVISION_KEYS}

    return compute
