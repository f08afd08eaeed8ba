"""The loaded target: runner, published facts, the start-up canary and the per-request engine computations.

Everything here runs on the engine worker thread (or the loader thread before it); the HTTP layer only
validates, enqueues and encodes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import eagle3_target
from eagle3_target import formats
from eagle3_target.contract import VocabMapping, build_batch
from eagle3_target.engines import ENGINES
from eagle3_target.protocol import FORMATS, LoadPhase, TargetInfo
from eagle3_target.runners import InvalidInput, TargetRunner, check_inputs, load_runner, model_info
from eagle3_target.runners.base import ForwardHiddenUnsupported, text_config
from eagle3_target.server.batching import Tensors
from eagle3_target.server.errors import PayloadTooLarge, Unprocessable
from eagle3_target.server.fingerprint import model_fingerprint
from eagle3_target.server.loading import (
    LoadFailed,
    LoadTracker,
    preflight,
    wait_for_weights,
    weight_loading_progress,
)
from eagle3_target.server.settings import ServerSettings

log = logging.getLogger(__name__)

CANARY_TOKENS = 8


class CanaryError(LoadFailed):
    """The model loaded but its first forward produced output that cannot be right."""

    def __init__(self, detail: str) -> None:
        super().__init__(
            f"the start-up canary failed: {detail}; the checkpoint's weights are broken or --dtype cannot "
            "represent them: check both"
        )


@dataclass(frozen=True)
class LoadedTarget:
    """A loaded runner, the device its inputs go to, and what the server publishes about it: `info`, the
    /v1/info answer, is the one record of its sizes, limits and fingerprint."""

    runner: TargetRunner
    device: torch.device
    info: TargetInfo


def engine_kwargs(settings: ServerSettings) -> dict[str, Any]:
    """Engine-specific keyword arguments: a sharded engine takes TP and context length; others one device."""
    if not ENGINES[settings.engine].sharded:
        if settings.tensor_parallel_size != 1:
            raise LoadFailed(
                f"the {settings.engine} engine runs on one device; "
                "set --tensor-parallel-size 1 or use --engine vllm"
            )
        return dict(settings.engine_args)
    extra: dict[str, Any] = {"tensor_parallel_size": settings.tensor_parallel_size}
    if settings.max_model_len is not None:
        extra["max_model_len"] = settings.max_model_len
    return {**extra, **settings.engine_args}


def run_canary(runner: TargetRunner, *, hidden_size: int, vocab_size: int) -> None:
    """One short forward whose output must be finite, shaped per the config, with non-zero aux layers."""
    input_ids = (torch.arange(CANARY_TOKENS, dtype=torch.int64) * 7919 % vocab_size).unsqueeze(0)
    with torch.inference_mode():
        logits, aux = runner.forward_eagle3(input_ids, torch.ones_like(input_ids))
    if tuple(logits.shape) != (1, CANARY_TOKENS, vocab_size):
        raise CanaryError(
            f"canary logits have shape {tuple(logits.shape)}, expected (1, {CANARY_TOKENS}, {vocab_size})"
        )
    if tuple(aux.shape) != (1, CANARY_TOKENS, 3 * hidden_size):
        raise CanaryError(
            f"canary aux has shape {tuple(aux.shape)}, expected (1, {CANARY_TOKENS}, {3 * hidden_size})"
        )
    if not bool(torch.isfinite(logits).all()) or not bool(torch.isfinite(aux).all()):
        raise CanaryError("canary forward produced non-finite values")
    for i, layer in enumerate(aux.split(hidden_size, dim=-1)):
        if not bool(layer.any()):
            raise CanaryError(f"canary aux layer {runner.aux_layer_ids[i]} is all zeros")


def load_target(settings: ServerSettings, tracker: LoadTracker | None = None) -> LoadedTarget:
    """Check what can be refused at once, wait for weights still arriving, load the runner, run the canary
    and compute the published identity, reporting each phase to `tracker`. Slow: runs off the event loop.
    Raises LoadFailed (or the engine's own error) when the model cannot be served."""
    tracker = tracker or LoadTracker()
    kwargs = engine_kwargs(settings)
    preflight(settings.model, settings.engine, kwargs)
    wait_for_weights(Path(settings.model), tracker)
    message = ENGINES[settings.engine].loading_message
    tracker.update(LoadPhase.LOADING, message)
    with weight_loading_progress(tracker, message):
        runner = load_runner(
            settings.engine,
            settings.model,
            dtype=settings.dtype,
            aux_layer_ids=list(settings.aux_layer_ids) if settings.aux_layer_ids else None,
            trust_remote_code=settings.trust_remote_code,
            **kwargs,
        )
    tracker.update(LoadPhase.CANARY, "running the start-up canary")
    facts = model_info(runner)
    try:
        run_canary(runner, hidden_size=facts.hidden_size, vocab_size=facts.vocab_size)
    except BaseException:
        runner.close()
        raise
    config = text_config(runner.model.config)
    max_len = settings.max_model_len or getattr(config, "max_position_embeddings", None) or 2**31 - 1
    # An engine may take fewer tokens than its context (vLLM keeps one slot for the generated token).
    max_len = min(max_len, getattr(runner, "max_prompt_len", max_len))
    dtype_name = str(facts.dtype).removeprefix("torch.")
    aux_ids = list(runner.aux_layer_ids)
    fingerprint = model_fingerprint(
        settings.model,
        model_name=settings.display_name,
        revision=settings.revision,
        dtype=dtype_name,
        engine=settings.engine,
        aux_layer_ids=aux_ids,
    )
    info = TargetInfo(
        model=settings.display_name,
        revision=settings.revision,
        engine=settings.engine,
        dtype=dtype_name,
        num_hidden_layers=facts.num_hidden_layers,
        hidden_size=facts.hidden_size,
        vocab_size=facts.vocab_size,
        aux_layer_ids=aux_ids,
        fingerprint=fingerprint,
        formats=list(FORMATS),
        max_batch_tokens=settings.max_batch_tokens,
        max_model_len=int(max_len),
        version=eagle3_target.__version__,
    )
    return LoadedTarget(runner=runner, device=facts.device, info=info)


def weight_tensor(target: LoadedTarget, name: str) -> Tensor:
    """One of `protocol.WEIGHT_NAMES` as the contiguous CPU tensor the wire formats encode."""
    getters = {
        "input_embeddings": target.runner.input_embedding_weight,
        "lm_head": target.runner.lm_head_weight,
        "final_norm": target.runner.final_norm_weight,
    }
    return getters[name]().detach().cpu().contiguous()


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
        raise Unprocessable(f"unexpected tensors {unexpected}; expected {list(required + optional)}")
    missing = [name for name in required if name not in tensors]
    if missing:
        raise Unprocessable(f"missing required tensors {missing}")
    input_ids = tensors["input_ids"]
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise Unprocessable(f"input_ids must be int64 or int32, got {input_ids.dtype}")
    if input_ids.dim() == 2 and input_ids.shape[1] > max_model_len:
        raise Unprocessable(f"sequence length {input_ids.shape[1]} exceeds max-model-len {max_model_len}")
    if input_ids.numel() > max_batch_tokens:
        raise PayloadTooLarge(f"{input_ids.numel()} tokens exceed max-batch-tokens {max_batch_tokens}")
    try:
        ids, attention_mask = check_inputs(input_ids, tensors.get("attention_mask"), vocab_size)
        checked = {"input_ids": ids, "attention_mask": attention_mask}
        for name in (*required, *optional):
            if name in tensors and name not in checked:
                checked[name] = check_mask(name, tensors[name], ids)
    except InvalidInput as exc:
        raise Unprocessable(str(exc)) from exc
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
