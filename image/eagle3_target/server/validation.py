"""A request's token batch, checked before it is queued for the engine: 422 for bad input, 413 for more
tokens than one batch may hold. Runs in the threadpool, off the event loop."""

from __future__ import annotations

import torch
from torch import Tensor

from eagle3_target.runners import InvalidInput, check_inputs
from eagle3_target.server.batching import Tensors
from eagle3_target.server.refusals import Invalid, TooLarge


def validate_token_batch(
    tensors: Tensors,
    *,
    required: tuple[str, ...],
    optional: tuple[str, ...],
    vocab_size: int,
    max_model_len: int,
    max_batch_tokens: int,
) -> Tensors:
    """Check a decoded request batch and return int64 tensors; 422 for bad input, 413 when too many tokens."""
    unexpected = sorted(set(tensors) - set(required) - set(optional))
    if unexpected:
        raise Invalid(f"unexpected tensors {unexpected}; expected {list(required + optional)}")
    missing = [name for name in required if name not in tensors]
    if missing:
        raise Invalid(f"missing required tensors {missing}")
    input_ids = tensors["input_ids"]
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise Invalid(f"input_ids must be int64 or int32, got {input_ids.dtype}")
    if input_ids.dim() == 2 and input_ids.shape[1] > max_model_len:
        raise Invalid(f"sequence length {input_ids.shape[1]} exceeds max-model-len {max_model_len}")
    if input_ids.numel() > max_batch_tokens:
        raise TooLarge(f"{input_ids.numel()} tokens exceed max-batch-tokens {max_batch_tokens}")
    try:
        ids, attention_mask = check_inputs(input_ids, tensors.get("attention_mask"), vocab_size)
        checked = {"input_ids": ids, "attention_mask": attention_mask}
        for name in (*required, *optional):
            if name in tensors and name not in checked:
                checked[name] = check_mask(name, tensors[name], ids)
    except InvalidInput as exc:
        raise Invalid(str(exc)) from exc
    return checked


def check_mask(name: str, mask: Tensor, input_ids: Tensor) -> Tensor:
    """A 0/1 mask shaped like input_ids, as int64."""
    if tuple(mask.shape) != tuple(input_ids.shape):
        raise InvalidInput(f"{name} shape {tuple(mask.shape)} != input_ids {tuple(input_ids.shape)}")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise InvalidInput(f"{name} must be integer or bool, got {mask.dtype}")
    mask = mask.long()
    if bool(((mask != 0) & (mask != 1)).any()):
        raise InvalidInput(f"{name} must hold only 0 and 1")
    return mask
