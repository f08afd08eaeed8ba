"""The four supervision formats the server ships, computed from one runner output, and their inverses.

Server side, `supervision` turns (final hidden, aux) into one format, position-aligned (unshifted).
Client side, `batch_from_supervision` rebuilds from any format the batch NeMo's co-located HF backend would
have produced: the shift is applied to the full-vocab quantities *before* the projection, exactly as NeMo
does, so the zero row the shift appends becomes a uniform draft distribution with an unset position mask.

Exactness: every format is the same math as on the full logits `final_hidden @ lm_head.T` in the model
dtype (the HF lm_head's path). When `chunk_tokens` covers the whole batch the GEMM is literally the one the
model runs; smaller chunks change only the GEMM's row count, which is bit-neutral in bf16 but, with some
fp32 BLAS kernels, can move a logit by an ulp.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional

from eagle3_target.contract import (
    Eagle3TargetBatch,
    VocabMapping,
    build_batch,
    check_aligned,
    shift_left,
)
from eagle3_target.protocol import FORMATS

# 1024 tokens of fp32 logits at V=128k is 0.5 GB: small next to an 8B model, and big enough to keep
# the GEMM efficient.
DEFAULT_CHUNK_TOKENS = 1024


def logits_from_hidden(final_hidden: Tensor, lm_head_weight: Tensor) -> Tensor:
    """Full logits [..., V] in the model dtype, as the HF lm_head computes them."""
    if final_hidden.dtype != lm_head_weight.dtype:
        raise ValueError(f"final_hidden is {final_hidden.dtype} but lm_head is {lm_head_weight.dtype}")
    if lm_head_weight.dim() != 2 or final_hidden.shape[-1] != lm_head_weight.shape[1]:
        raise ValueError(
            f"lm_head {tuple(lm_head_weight.shape)} does not fit final_hidden {tuple(final_hidden.shape)}"
        )
    return functional.linear(final_hidden, lm_head_weight.to(final_hidden.device))


def probs_from_draft(
    draft_logits: Tensor, argmax: Tensor, mapping: VocabMapping, loss_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """NeMo's projection from the `draft` format: (target_probs fp32 [B,S,Vd], position_mask [B,S,1]).

    All inputs must be in the same frame (all shifted, for the trainer).
    """
    mapping = mapping.to(draft_logits.device)
    target_probs = torch.softmax(draft_logits.float(), dim=-1)
    position_mask = (mapping.selected_token_mask[argmax] & loss_mask.bool().to(argmax.device)).unsqueeze(-1)
    return target_probs, position_mask


def _check_format(fmt: str, mapping: VocabMapping | None) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown supervision format {fmt!r}; expected one of {tuple(FORMATS)}")
    if FORMATS[fmt].needs_vocab and mapping is None:
        raise ValueError(f"format {fmt!r} needs a vocab mapping")


def supervision(
    fmt: str,
    final_hidden: Tensor,
    aux: Tensor,
    lm_head_weight: Tensor,
    *,
    mapping: VocabMapping | None = None,
    logits_dtype: torch.dtype = torch.float32,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> dict[str, Tensor]:
    """The tensors of one format, unshifted. Full logits exist only one chunk of tokens at a time."""
    _check_format(fmt, mapping)
    if final_hidden.dim() != 3:
        raise ValueError(f"final_hidden must be [B, S, H], got {tuple(final_hidden.shape)}")
    check_aligned(tuple(final_hidden.shape[:2]), aux)
    if fmt == "hidden":
        return {"aux_hidden_states": aux, "final_hidden": final_hidden}
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    vocab = lm_head_weight.shape[0]
    if mapping is not None and mapping.vocab_size != vocab:
        raise ValueError(f"the mapping is for vocab {mapping.vocab_size}, the lm_head has {vocab} rows")
    batch, seq, _ = final_hidden.shape
    rows = final_hidden.reshape(batch * seq, -1)
    device = rows.device
    lm_head_weight = lm_head_weight.to(device)
    out: dict[str, Tensor]
    if fmt == "logits":
        out = {"logits": torch.empty(batch * seq, vocab, dtype=logits_dtype, device=device)}
    else:
        assert mapping is not None  # _check_format requires it for the draft-vocab formats
        mapping = mapping.to(device)
        draft_vocab = mapping.draft_vocab_size
        if fmt == "draft":
            out = {
                "draft_logits": torch.empty(batch * seq, draft_vocab, dtype=rows.dtype, device=device),
                "logsumexp": torch.empty(batch * seq, dtype=torch.float32, device=device),
                "argmax": torch.empty(batch * seq, dtype=torch.int64, device=device),
            }
        else:
            out = {
                "target_probs": torch.empty(batch * seq, draft_vocab, dtype=torch.float32, device=device),
                "position_mask": torch.empty(batch * seq, dtype=torch.bool, device=device),
            }
    for start in range(0, batch * seq, chunk_tokens):
        part = slice(start, start + chunk_tokens)
        logits = logits_from_hidden(rows[part], lm_head_weight)
        if fmt == "logits":
            out["logits"][part] = logits
        elif fmt == "draft":
            out["draft_logits"][part] = logits.index_select(-1, mapping.selected_token_ids)
            out["logsumexp"][part] = torch.logsumexp(logits.float(), dim=-1)
            out["argmax"][part] = logits.argmax(dim=-1)
        else:
            draft = logits.index_select(-1, mapping.selected_token_ids)
            out["target_probs"][part] = torch.softmax(draft.float(), dim=-1)
            out["position_mask"][part] = mapping.selected_token_mask[logits.argmax(dim=-1)]
    result = {"aux_hidden_states": aux}
    result.update({name: t.reshape(batch, seq, *t.shape[1:]) for name, t in out.items()})
    return result


def batch_from_supervision(
    fmt: str,
    tensors: dict[str, Tensor],
    input_ids: Tensor,
    attention_mask: Tensor,
    loss_mask: Tensor,
    *,
    mapping: VocabMapping | None = None,
    lm_head_weight: Tensor | None = None,
) -> Eagle3TargetBatch:
    """Rebuild NeMo's training batch from one format's (unshifted) tensors.

    `hidden` needs the lm_head weight; `draft` and `probs` need the mapping they were computed with.
    With a mapping the batch carries draft-vocab probabilities, without one full logits.
    """
    _check_format(fmt, mapping)
    missing = [name for name in FORMATS[fmt].tensors if name not in tensors]
    if missing:
        raise ValueError(f"format {fmt!r} needs tensors {missing}, got {sorted(tensors)}")
    aux = tensors["aux_hidden_states"]
    if fmt in ("hidden", "logits"):
        if fmt == "hidden":
            if lm_head_weight is None:
                raise ValueError("format 'hidden' needs the lm_head weight to rebuild the logits")
            logits = logits_from_hidden(tensors["final_hidden"], lm_head_weight)
        else:
            logits = tensors["logits"]
        return build_batch(logits, aux, input_ids, attention_mask, loss_mask, mapping)
    assert mapping is not None  # _check_format requires it for the draft-vocab formats
    draft_vocab = tensors["draft_logits" if fmt == "draft" else "target_probs"].shape[-1]
    if draft_vocab != mapping.draft_vocab_size:
        raise ValueError(
            f"the supervision has {draft_vocab} draft tokens, the mapping {mapping.draft_vocab_size}"
        )
    check_aligned(tuple(input_ids.shape), aux, *(tensors[name] for name in FORMATS[fmt].tensors), loss_mask)
    shifted_loss_mask = shift_left(loss_mask)
    if fmt == "draft":
        target_probs, position_mask = probs_from_draft(
            shift_left(tensors["draft_logits"]), shift_left(tensors["argmax"]), mapping, shifted_loss_mask
        )
    else:
        probs = tensors["target_probs"]
        # NeMo shifts the logits, so its tail row is the softmax of zeros, not zeros.
        tail = torch.softmax(torch.zeros_like(probs[:, :1]), dim=-1)
        target_probs = torch.cat((probs[:, 1:], tail), dim=1)
        position_mask = (shift_left(tensors["position_mask"]) & shifted_loss_mask.bool()).unsqueeze(-1)
    return Eagle3TargetBatch(
        aux_hidden_states=aux,
        input_ids=shift_left(input_ids),
        attention_mask=attention_mask,
        loss_mask=shifted_loss_mask,
        target_probs=target_probs,
        position_mask=position_mask,
    )
