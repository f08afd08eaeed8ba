"""The EAGLE-3 supervision contract: aux-layer rules, the next-token shift and the draft-vocab projection.

Every backend (HF, vLLM, the remote server and its client) goes through this module so they agree bit for bit
with NeMo AutoModel's co-located HF backend, which is the reference the draft trainer was written against.
"""

from __future__ import annotations

import copy
import hashlib
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from eagle3_target.protocol import MAX_CAPTURE_LAYERS

NUM_AUX_LAYERS = 3


def _layer_ids(ids: Sequence[int], what: str) -> list[int]:
    try:
        return [operator.index(i) for i in ids]
    except TypeError as exc:
        raise ValueError(f"{what} must be integers, got {list(ids)!r}") from exc


def _check_layer_ids(checked: list[int], num_layers: int, what: str) -> list[int]:
    if len(set(checked)) != len(checked):
        raise ValueError(f"{what} must be distinct, got {checked}")
    for i in checked:
        if not 0 <= i < num_layers:
            raise ValueError(f"{what[:-1]} {i} is out of range for a model with {num_layers} layers")
    return checked


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The EAGLE-3 low/mid/high recipe `[1, L//2 - 1, L - 4]` (HF ids: output of decoder layer i).

    Shallow models would produce duplicate or negative ids; we refuse rather than silently capture fewer
    than three layers, which would only surface later as a shape error in the draft's `fc`.
    """
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    if any(not 0 <= i < num_layers for i in ids) or len(set(ids)) != NUM_AUX_LAYERS:
        raise ValueError(
            f"a model with num_hidden_layers={num_layers} is too shallow for the default EAGLE-3 aux layers "
            f"{ids}; pass 3 distinct aux layer ids in [0, {num_layers}) explicitly"
        )
    return ids


def validate_aux_layer_ids(ids: Sequence[int], num_layers: int) -> list[int]:
    """Check an explicit EAGLE-3 selection: exactly 3 distinct integer ids in [0, num_layers)."""
    checked = _layer_ids(ids, "aux layer ids")
    if len(checked) != NUM_AUX_LAYERS:
        raise ValueError(
            f"EAGLE-3 needs exactly {NUM_AUX_LAYERS} aux layer ids, got {len(checked)}: {checked}"
        )
    return _check_layer_ids(checked, num_layers, "aux layer ids")


def validate_capture_layer_ids(ids: Sequence[int], num_layers: int) -> list[int]:
    """Check a capture set: 1 to MAX_CAPTURE_LAYERS distinct integer ids in [0, num_layers), in the order
    given. Id L-1, the last decoder layer's output, is the last hidden state before the final norm."""
    checked = _layer_ids(ids, "capture layer ids")
    if not 1 <= len(checked) <= MAX_CAPTURE_LAYERS:
        raise ValueError(
            f"a capture set has 1 to {MAX_CAPTURE_LAYERS} layer ids, got {len(checked)}: {checked}"
        )
    return _check_layer_ids(checked, num_layers, "capture layer ids")


def capture_plan(
    num_layers: int, aux_layer_ids: Sequence[int] | None, capture_layer_ids: Sequence[int] | None
) -> tuple[list[int], list[int]]:
    """(aux, capture) layer ids of a target: the aux layers default to the EAGLE-3 recipe, the capture set
    to the aux layers, and the aux layers must be captured (the EAGLE-3 formats ship them)."""
    aux = (
        default_aux_layer_ids(num_layers)
        if aux_layer_ids is None
        else validate_aux_layer_ids(aux_layer_ids, num_layers)
    )
    if capture_layer_ids is None:
        return aux, aux
    capture = validate_capture_layer_ids(capture_layer_ids, num_layers)
    missing = [i for i in aux if i not in capture]
    if missing:
        raise ValueError(
            f"the aux layers {aux} must be captured, but the capture set {capture} lacks {missing}: add them "
            "to the capture layer ids or choose aux layer ids among them"
        )
    return aux, capture


def select_layers(captured: Tensor, captured_ids: Sequence[int], wanted: Sequence[int]) -> Tensor:
    """The `wanted` layers, concatenated in that order ([B, S, k*H]), from `captured` ([B, S, n*H], the
    layers `captured_ids` in that order). The captured tensor itself when all of it is wanted in order."""
    captured_ids, wanted = list(captured_ids), list(wanted)
    if wanted == captured_ids:
        return captured
    missing = [i for i in wanted if i not in captured_ids]
    if missing:
        raise ValueError(f"layers {missing} are not among the captured layers {captured_ids}")
    width = captured.shape[-1] // len(captured_ids)
    positions = torch.tensor([captured_ids.index(i) for i in wanted], device=captured.device)
    per_layer = captured.unflatten(-1, (len(captured_ids), width))
    return per_layer.index_select(-2, positions).flatten(-2)


def shift_left(t: Tensor) -> Tensor:
    """Shift along the sequence dim (1) by one and append zeros: slot t then holds position t+1's value."""
    if t.dim() < 2:
        raise ValueError(f"shift_left needs a [B, S, ...] tensor, got shape {tuple(t.shape)}")
    return torch.cat((t[:, 1:], torch.zeros_like(t[:, :1])), dim=1)


@dataclass
class Eagle3TargetBatch:
    """One draft-training batch of target supervision, in the trainer's (shifted) frame.

    `aux_hidden_states` and `attention_mask` are position-aligned; `input_ids`, `loss_mask` and the
    supervision are shifted left by one. It carries exactly one supervision encoding: full-vocab `logits`
    (projected by the trainer) or draft-vocab `target_probs` + `position_mask` (already projected).
    """

    aux_hidden_states: Tensor
    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    logits: Tensor | None = None
    target_probs: Tensor | None = None
    position_mask: Tensor | None = None

    def __post_init__(self) -> None:
        has_logits = self.logits is not None
        has_probs = self.target_probs is not None and self.position_mask is not None
        half_probs = (self.target_probs is None) != (self.position_mask is None)
        if has_logits == has_probs or half_probs:
            raise ValueError(
                "Eagle3TargetBatch needs exactly one supervision encoding: `logits`, or both "
                "`target_probs` and `position_mask`"
            )

    def to_trainer_inputs(self) -> dict[str, Tensor]:
        """Keyword arguments for NeMo's `Eagle3TrainerModule.forward`."""
        inputs = {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "loss_mask": self.loss_mask,
            "aux_hidden_states": self.aux_hidden_states,
        }
        if self.logits is not None:
            inputs["target_logits"] = self.logits
        else:
            assert self.target_probs is not None and self.position_mask is not None  # see __post_init__
            inputs["target_probs"] = self.target_probs
            inputs["position_mask"] = self.position_mask
        return inputs


@dataclass(frozen=True)
class VocabMapping:
    """The draft vocabulary: `selected_token_ids` [Vd] int64 and `selected_token_mask` [V] bool.

    Validated on construction, so a mapping that exists is consistent (ids unique and in range, the mask
    set exactly at those ids); a wrong mapping would otherwise silently train the draft on the wrong tokens.
    """

    selected_token_ids: Tensor
    selected_token_mask: Tensor
    _digest: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()
        # Taken once here, where the ids were just read anyway: asking for it later never syncs a device.
        h = hashlib.sha256(f"V={self.vocab_size};".encode())
        h.update(self.selected_token_ids.cpu().numpy().astype("<i8").tobytes())
        object.__setattr__(self, "_digest", h.hexdigest())

    @classmethod
    def from_selected_ids(cls, ids: Tensor | Sequence[int], vocab_size: int) -> VocabMapping:
        """Build the mapping (and its mask) from the selected target token ids, in draft order."""
        ids_t = torch.as_tensor(ids)
        if ids_t.dtype.is_floating_point or ids_t.dtype.is_complex or ids_t.dtype == torch.bool:
            raise ValueError(f"selected_token_ids must be integers, got dtype {ids_t.dtype}")
        ids_t = ids_t.to(torch.int64)
        if ids_t.dim() != 1:
            raise ValueError(f"selected_token_ids must be 1-D, got shape {tuple(ids_t.shape)}")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        if ids_t.numel() and (int(ids_t.min()) < 0 or int(ids_t.max()) >= vocab_size):
            raise ValueError(f"selected_token_ids must lie in [0, {vocab_size})")
        mask = torch.zeros(vocab_size, dtype=torch.bool, device=ids_t.device)
        mask[ids_t] = True
        return cls(ids_t, mask)

    @property
    def vocab_size(self) -> int:
        return self.selected_token_mask.numel()

    @property
    def draft_vocab_size(self) -> int:
        return self.selected_token_ids.numel()

    def validate(self) -> VocabMapping:
        """Raise ValueError unless the ids and the mask describe the same non-empty draft vocabulary."""
        ids, mask = self.selected_token_ids, self.selected_token_mask
        if not isinstance(ids, Tensor) or not isinstance(mask, Tensor):
            raise ValueError("selected_token_ids and selected_token_mask must be tensors")
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError(
                f"selected_token_ids must be int64 [Vd], got {ids.dtype} of shape {tuple(ids.shape)}"
            )
        if mask.dtype != torch.bool or mask.dim() != 1:
            raise ValueError(
                f"selected_token_mask must be bool [V], got {mask.dtype} of shape {tuple(mask.shape)}"
            )
        if ids.numel() == 0:
            raise ValueError("the draft vocabulary is empty")
        if ids.numel() > mask.numel():
            raise ValueError(f"draft vocab ({ids.numel()}) is larger than the target vocab ({mask.numel()})")
        if int(ids.min()) < 0 or int(ids.max()) >= mask.numel():
            raise ValueError(f"selected_token_ids must lie in [0, {mask.numel()})")
        if torch.unique(ids).numel() != ids.numel():
            raise ValueError("selected_token_ids must be unique")
        if int(mask.sum()) != ids.numel() or not bool(mask.to(ids.device)[ids].all()):
            raise ValueError("selected_token_mask must be True exactly at selected_token_ids")
        return self

    def to(self, device: torch.device | str) -> VocabMapping:
        """The same mapping on ``device``: moved, not validated again (its content did not change)."""
        if self.selected_token_ids.device == torch.device(device):
            return self
        moved = copy.copy(self)
        object.__setattr__(moved, "selected_token_ids", self.selected_token_ids.to(device))
        object.__setattr__(moved, "selected_token_mask", self.selected_token_mask.to(device))
        return moved

    def digest(self) -> str:
        """A stable content id (sha256 over target vocab size and ids), e.g. to key stored mappings."""
        return self._digest


def project_to_draft_vocab(logits: Tensor, mapping: VocabMapping, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """NeMo's projection: (softmax over the draft-vocab logits in fp32 [B,S,Vd], position mask [B,S,1]).

    A position is supervised only where the target's full-vocab argmax is a draft token and the loss mask
    is set. Apply it to logits and loss mask in the same frame (the trainer's: both shifted).
    """
    if logits.shape[-1] != mapping.vocab_size:
        raise ValueError(
            f"logits have vocab {logits.shape[-1]} but the mapping is for vocab {mapping.vocab_size}"
        )
    if tuple(loss_mask.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"loss_mask shape {tuple(loss_mask.shape)} does not match logits {tuple(logits.shape)}"
        )
    mapping = mapping.to(logits.device)
    top = logits.argmax(dim=-1)
    position_mask = (mapping.selected_token_mask[top] & loss_mask.bool()).unsqueeze(-1)
    target_probs = torch.softmax(logits.index_select(-1, mapping.selected_token_ids).float(), dim=-1)
    return target_probs, position_mask


def check_aligned(batch_shape: tuple[int, ...], aux: Tensor, *others: Tensor) -> None:
    """Raise ValueError unless aux is [B,S,3H] and the other tensors start with the same [B,S]."""
    bs = tuple(batch_shape)
    if len(bs) != 2:
        raise ValueError(f"expected a [B, S] batch, got shape {bs}")
    if aux.dim() != 3 or tuple(aux.shape[:2]) != bs or aux.shape[-1] % NUM_AUX_LAYERS:
        raise ValueError(f"aux_hidden_states must be [B, S, 3H] with [B, S]={bs}, got {tuple(aux.shape)}")
    for t in others:
        if tuple(t.shape[:2]) != bs:
            raise ValueError(f"tensor of shape {tuple(t.shape)} does not match [B, S]={bs}")


def build_batch(
    logits: Tensor,
    aux: Tensor,
    input_ids: Tensor,
    attention_mask: Tensor,
    loss_mask: Tensor,
    mapping: VocabMapping | None = None,
) -> Eagle3TargetBatch:
    """Turn unshifted runner output into the trainer's batch, exactly as NeMo's HF backend does.

    Without a mapping the batch carries the shifted full logits; with one it carries the draft-vocab
    projection of the shifted logits (what NeMo's remote server computes), so the zero row appended by the
    shift becomes a uniform distribution with an unset position mask, as in NeMo.
    """
    check_aligned(tuple(input_ids.shape), aux, logits, attention_mask, loss_mask)
    shifted_logits = shift_left(logits)
    shifted_loss_mask = shift_left(loss_mask)
    common = {
        "aux_hidden_states": aux,
        "input_ids": shift_left(input_ids),
        "attention_mask": attention_mask,
        "loss_mask": shifted_loss_mask,
    }
    if mapping is None:
        return Eagle3TargetBatch(**common, logits=shifted_logits)
    target_probs, position_mask = project_to_draft_vocab(shifted_logits, mapping, shifted_loss_mask)
    return Eagle3TargetBatch(**common, target_probs=target_probs, position_mask=position_mask)
