"""Rebuild the trainer's batch from what a supervision format put on the wire (pure functions, no I/O).

The server answers position-aligned (unshifted) tensors; the trainer's frame is shifted left by one with a
zero row appended (DESIGN §2). Each format is turned back into exactly what `contract.build_batch` makes from
full logits, so a remote target and the in-process HF backend give the same batch bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3_target.contract import Eagle3TargetBatch, VocabMapping, build_batch, shift_left

FORMATS = ("hidden", "draft", "probs", "logits")
NEEDS_VOCAB = frozenset({"draft", "probs"})


def logits_from_hidden(final_hidden: Tensor, lm_head: Tensor) -> Tensor:
    """Full-vocab logits from the post-norm final hidden state, as the model's bias-free LM head does."""
    return F.linear(final_hidden, lm_head.to(final_hidden.dtype))


def batch_from_supervision(
    format: str,
    raw: dict[str, Tensor],
    input_ids: Tensor,
    attention_mask: Tensor,
    loss_mask: Tensor,
    *,
    mapping: VocabMapping | None = None,
    lm_head: Tensor | None = None,
) -> Eagle3TargetBatch:
    """The `Eagle3TargetBatch` for an answer of `format` (`lm_head` for hidden, `mapping` for draft/probs)."""
    aux = raw["aux_hidden_states"]
    if format == "logits":
        return build_batch(raw["logits"], aux, input_ids, attention_mask, loss_mask, mapping)
    if format == "hidden":
        if lm_head is None:
            raise ValueError("format 'hidden' needs the target's lm_head weight")
        logits = logits_from_hidden(raw["final_hidden"], lm_head)
        return build_batch(logits, aux, input_ids, attention_mask, loss_mask, mapping)
    if format not in NEEDS_VOCAB:
        raise ValueError(f"unknown supervision format {format!r}; expected one of {FORMATS}")
    if mapping is None:
        raise ValueError(f"format {format!r} needs the draft vocab mapping it was requested with")
    shifted_loss_mask = shift_left(loss_mask)
    if format == "draft":
        target_probs = torch.softmax(shift_left(raw["draft_logits"]).float(), dim=-1)
        in_draft_vocab = mapping.to(aux.device).selected_token_mask[shift_left(raw["argmax"])]
    else:
        target_probs = shift_left_probs(raw["target_probs"])
        in_draft_vocab = shift_left(raw["position_mask"].bool())
    return Eagle3TargetBatch(
        aux_hidden_states=aux,
        input_ids=shift_left(input_ids),
        attention_mask=attention_mask,
        loss_mask=shifted_loss_mask,
        target_probs=target_probs,
        position_mask=(in_draft_vocab & shifted_loss_mask.bool()).unsqueeze(-1),
    )


def shift_left_probs(probs: Tensor) -> Tensor:
    """Shift draft-vocab probabilities; the appended row is softmax of the zero logits the shift creates."""
    appended = torch.softmax(torch.zeros_like(probs[:, :1]), dim=-1)
    return torch.cat((probs[:, 1:], appended), dim=1)
