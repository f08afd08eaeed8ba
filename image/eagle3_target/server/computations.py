"""What the server computes from the loaded target for a request: the native supervision formats and NeMo's
`/generate` batch (run on the engine worker thread as an `EngineJob`'s computation), and the published
weights. The HTTP layer only validates, enqueues and encodes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from eagle3_target import formats
from eagle3_target.contract import VocabMapping, build_batch
from eagle3_target.protocol import FORMATS
from eagle3_target.runners.base import ForwardHiddenUnsupported
from eagle3_target.server.batching import Tensors
from eagle3_target.server.target import LoadedTarget


def weight_tensor(target: LoadedTarget, name: str) -> Tensor:
    """One of `protocol.WEIGHT_NAMES` as the contiguous CPU tensor the wire formats encode."""
    getters = {
        "input_embeddings": target.runner.input_embedding_weight,
        "lm_head": target.runner.lm_head_weight,
        "final_norm": target.runner.final_norm_weight,
    }
    return getters[name]().detach().cpu().contiguous()


def supervision_compute(
    target: LoadedTarget, fmt: str, logits_dtype: torch.dtype, mapping: VocabMapping | None
) -> Callable[[Tensors], Tensors]:
    """The native ``/v1/supervision`` computation for one format; outputs on the CPU, unshifted."""

    def compute(inputs: Tensors) -> Tensors:
        input_ids = inputs["input_ids"].to(target.device)
        attention_mask = inputs["attention_mask"].to(target.device)
        final_hidden, aux = target.runner.forward_hidden(
            input_ids, attention_mask, prenorm=FORMATS[fmt].prenorm
        )
        out = formats.supervision(
            fmt, final_hidden, aux, target.runner.lm_head_weight(), mapping=mapping, logits_dtype=logits_dtype
        )
        return {name: tensor.cpu() for name, tensor in out.items()}

    return compute


NEMO_SUPERVISION_KEYS = ("aux_hidden_states", "target_probs", "position_mask", "input_ids", "loss_mask")


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
            final_hidden, aux = runner.forward_hidden(input_ids, attention_mask)
        except ForwardHiddenUnsupported:
            logits, aux = runner.forward_eagle3(input_ids, attention_mask)
            batch = build_batch(logits, aux, input_ids, attention_mask, loss_mask, mapping=mapping)
        else:
            probs = formats.supervision("probs", final_hidden, aux, runner.lm_head_weight(), mapping=mapping)
            batch = formats.batch_from_supervision(
                "probs", probs, input_ids, attention_mask, loss_mask, mapping=mapping
            )
        return {name: getattr(batch, name).cpu() for name in NEMO_SUPERVISION_KEYS}

    return compute
