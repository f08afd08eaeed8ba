"""The supervision formats the server ships, computed from one runner output, and their inverses.

Each format is one `Computation` in `COMPUTATIONS` (its names and query parameters are in
`protocol.FORMATS`). Server side, `supervision` turns (final hidden, aux) into one format, position-aligned
(unshifted). Client side, `batch_from_supervision` rebuilds from any format the batch NeMo's co-located HF
backend would have produced: the shift is applied to the full-vocab quantities *before* the projection,
exactly as NeMo does, so the zero row the shift appends becomes a uniform draft distribution with an unset
position mask.

Exactness: every format is the same math as on the full logits `final_hidden @ lm_head.T` in the model
dtype (the HF lm_head's path). When `chunk_tokens` covers the whole batch the GEMM is literally the one the
model runs; smaller chunks change only the GEMM's row count, which is bit-neutral in bf16 but, with some
fp32 BLAS kernels, can move a logit by an ulp.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional

from eagle3_target.contract import (
    NUM_AUX_LAYERS,
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


def _full_logits(
    logits: Tensor, mapping: VocabMapping | None, logits_dtype: torch.dtype
) -> dict[str, Tensor]:
    return {"logits": logits.to(logits_dtype)}


def _draft_logits(
    logits: Tensor, mapping: VocabMapping | None, logits_dtype: torch.dtype
) -> dict[str, Tensor]:
    assert mapping is not None  # protocol.FORMATS: needs_vocab
    return {
        "draft_logits": logits.index_select(-1, mapping.selected_token_ids),
        "logsumexp": torch.logsumexp(logits.float(), dim=-1),
        "argmax": logits.argmax(dim=-1),
    }


def _draft_probs(
    logits: Tensor, mapping: VocabMapping | None, logits_dtype: torch.dtype
) -> dict[str, Tensor]:
    assert mapping is not None  # protocol.FORMATS: needs_vocab
    draft = logits.index_select(-1, mapping.selected_token_ids)
    return {
        "target_probs": torch.softmax(draft.float(), dim=-1),
        "position_mask": mapping.selected_token_mask[logits.argmax(dim=-1)],
    }


@dataclass(frozen=True)
class Rebuild:
    """What the client needs to rebuild the trainer's batch from one format's tensors (all unshifted)."""

    tensors: dict[str, Tensor]
    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    mapping: VocabMapping | None
    lm_head_weight: Tensor | None

    def full_vocab(self, logits: Tensor) -> Eagle3TargetBatch:
        return build_batch(
            logits,
            self.tensors["aux_hidden_states"],
            self.input_ids,
            self.attention_mask,
            self.loss_mask,
            self.mapping,
        )

    def draft_vocab(self, target_probs: Tensor, position_mask: Tensor) -> Eagle3TargetBatch:
        """The batch from already shifted draft-vocab probabilities and position mask."""
        return Eagle3TargetBatch(
            aux_hidden_states=self.tensors["aux_hidden_states"],
            input_ids=shift_left(self.input_ids),
            attention_mask=self.attention_mask,
            loss_mask=shift_left(self.loss_mask),
            target_probs=target_probs,
            position_mask=position_mask,
        )


def _rebuild_hidden(r: Rebuild) -> Eagle3TargetBatch:
    if r.lm_head_weight is None:
        raise ValueError("format 'hidden' needs the lm_head weight to rebuild the logits")
    return r.full_vocab(logits_from_hidden(r.tensors["final_hidden"], r.lm_head_weight))


def _refuse_prenorm(r: Rebuild) -> Eagle3TargetBatch:
    raise ValueError(
        "format 'hidden_prenorm' ships h_L before the final norm, for trainers that apply the target's norm "
        "themselves; the trainer batch is rebuilt from 'hidden'"
    )


def _rebuild_logits(r: Rebuild) -> Eagle3TargetBatch:
    return r.full_vocab(r.tensors["logits"])


def _rebuild_draft(r: Rebuild) -> Eagle3TargetBatch:
    assert r.mapping is not None  # protocol.FORMATS: needs_vocab
    target_probs, position_mask = probs_from_draft(
        shift_left(r.tensors["draft_logits"]),
        shift_left(r.tensors["argmax"]),
        r.mapping,
        shift_left(r.loss_mask),
    )
    return r.draft_vocab(target_probs, position_mask)


def _rebuild_probs(r: Rebuild) -> Eagle3TargetBatch:
    probs = r.tensors["target_probs"]
    # NeMo shifts the logits, so its tail row is the softmax of zeros, not zeros.
    tail = torch.softmax(torch.zeros_like(probs[:, :1]), dim=-1)
    position_mask = shift_left(r.tensors["position_mask"]) & shift_left(r.loss_mask).bool()
    return r.draft_vocab(torch.cat((probs[:, 1:], tail), dim=1), position_mask.unsqueeze(-1))


@dataclass(frozen=True)
class TokenSizes:
    """What one token's answer weighs depends on: the model's widths and the dtypes of what is shipped."""

    hidden_size: int
    vocab_size: int
    draft_vocab_size: int  # 0 without a vocab mapping
    model_itemsize: int  # hidden states and logits come in the model dtype
    logits_itemsize: int  # the `dtype=` of the formats that take one

    @property
    def aux(self) -> int:
        """The three captured layers, in every format."""
        return NUM_AUX_LAYERS * self.hidden_size * self.model_itemsize


@dataclass(frozen=True)
class Computation:
    """One format's math: server side from a chunk of full logits, client side back to the trainer's batch,
    and the bytes per token of its tensors beyond the aux layers (so an answer's size is known before it is
    computed)."""

    # A chunk of full logits [N, V] (model dtype) to this format's tensors for those N tokens; None for a
    # format that ships the final hidden state itself and needs no lm_head on the server.
    from_logits: Callable[[Tensor, VocabMapping | None, torch.dtype], dict[str, Tensor]] | None
    rebuild: Callable[[Rebuild], Eagle3TargetBatch]
    extra_bytes_per_token: Callable[[TokenSizes], int]
    # The format's tensor holding the draft vocabulary, checked against the mapping when rebuilding.
    draft_vocab_tensor: str | None = None


def _hidden_bytes(s: TokenSizes) -> int:
    return s.hidden_size * s.model_itemsize


def _draft_bytes(s: TokenSizes) -> int:
    return s.draft_vocab_size * s.model_itemsize + 4 + 8  # draft logits, fp32 logsumexp, int64 argmax


def _probs_bytes(s: TokenSizes) -> int:
    return s.draft_vocab_size * 4 + 1  # fp32 probabilities, bool position mask


def _logits_bytes(s: TokenSizes) -> int:
    return s.vocab_size * s.logits_itemsize


COMPUTATIONS: dict[str, Computation] = {
    "hidden": Computation(None, _rebuild_hidden, _hidden_bytes),
    "draft": Computation(_draft_logits, _rebuild_draft, _draft_bytes, draft_vocab_tensor="draft_logits"),
    "probs": Computation(_draft_probs, _rebuild_probs, _probs_bytes, draft_vocab_tensor="target_probs"),
    "logits": Computation(_full_logits, _rebuild_logits, _logits_bytes),
    "hidden_prenorm": Computation(None, _refuse_prenorm, _hidden_bytes),
}


def bytes_per_token(fmt: str, sizes: TokenSizes) -> int:
    """The data bytes per token of one format's answer (its safetensors header aside)."""
    return sizes.aux + COMPUTATIONS[fmt].extra_bytes_per_token(sizes)


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
    """The tensors of one format, unshifted. Full logits exist only one chunk of tokens at a time.

    `final_hidden` is what the runner gave for this format: h_L before the final norm for a `prenorm`
    format, final_norm(h_L) for every other.
    """
    _check_format(fmt, mapping)
    if final_hidden.dim() != 3:
        raise ValueError(f"final_hidden must be [B, S, H], got {tuple(final_hidden.shape)}")
    check_aligned(tuple(final_hidden.shape[:2]), aux)
    from_logits = COMPUTATIONS[fmt].from_logits
    if from_logits is None:
        return {"aux_hidden_states": aux, FORMATS[fmt].tensors[1]: final_hidden}
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    vocab = lm_head_weight.shape[0]
    if mapping is not None and mapping.vocab_size != vocab:
        raise ValueError(f"the mapping is for vocab {mapping.vocab_size}, the lm_head has {vocab} rows")
    batch, seq, _ = final_hidden.shape
    rows = final_hidden.reshape(batch * seq, -1)
    device = rows.device
    lm_head_weight = lm_head_weight.to(device)
    mapping = mapping.to(device) if mapping is not None else None
    out: dict[str, Tensor] = {}
    # At least one (possibly empty) chunk, so that an empty batch still gets its tensors' dtypes and widths.
    for start in range(0, max(batch * seq, 1), chunk_tokens):
        part = slice(start, start + chunk_tokens)
        for name, value in from_logits(
            logits_from_hidden(rows[part], lm_head_weight), mapping, logits_dtype
        ).items():
            if name not in out:
                out[name] = torch.empty(batch * seq, *value.shape[1:], dtype=value.dtype, device=device)
            out[name][part] = value
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
    computation = COMPUTATIONS[fmt]
    if computation.draft_vocab_tensor is not None:
        assert mapping is not None  # _check_format requires it for the draft-vocab formats
        draft_vocab = tensors[computation.draft_vocab_tensor].shape[-1]
        if draft_vocab != mapping.draft_vocab_size:
            raise ValueError(
                f"the supervision has {draft_vocab} draft tokens, the mapping {mapping.draft_vocab_size}"
            )
        aligned = (tensors[name] for name in FORMATS[fmt].tensors)
        check_aligned(tuple(input_ids.shape), tensors["aux_hidden_states"], *aligned, loss_mask)
    return computation.rebuild(
        Rebuild(tensors, input_ids, attention_mask, loss_mask, mapping, lm_head_weight)
    )
