"""The loaded target: its runner, the device its inputs go to and what /v1/info publishes about it, and
loading it (weights that may still be arriving, the engine, the start-up canary) on the loader thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import eagle3_target
from eagle3_target.contract import capture_plan
from eagle3_target.engines import ENGINES
from eagle3_target.protocol import SERVED_FORMATS, LoadPhase, TargetInfo
from eagle3_target.runners import TargetRunner, load_runner, model_info
from eagle3_target.runners.base import text_config
from eagle3_target.server.fingerprint import model_fingerprint
from eagle3_target.server.loading import (
    LoadFailed,
    LoadTracker,
    preflight,
    wait_for_weights,
    weight_loading_progress,
)
from eagle3_target.server.settings import ServerSettings

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
    """Engine-specific keyword arguments: a sharded engine takes TP, context length and the batch budget
    (which sizes its KV cache where no GPU share can); others run on one device."""
    if not ENGINES[settings.engine].sharded:
        if settings.tensor_parallel_size != 1:
            raise LoadFailed(
                f"the {settings.engine} engine runs on one device; "
                "set --tensor-parallel-size 1 or use --engine vllm"
            )
        return dict(settings.engine_args)
    extra: dict[str, Any] = {
        "tensor_parallel_size": settings.tensor_parallel_size,
        "max_batch_tokens": settings.max_batch_tokens,
    }
    if settings.max_model_len is not None:
        extra["max_model_len"] = settings.max_model_len
    return {**extra, **settings.engine_args}


def run_canary(runner: TargetRunner, *, hidden_size: int, vocab_size: int) -> None:
    """One short forward whose output must be finite, shaped per the config, with no captured layer all
    zeros."""
    input_ids = (torch.arange(CANARY_TOKENS, dtype=torch.int64) * 7919 % vocab_size).unsqueeze(0)
    layers = runner.capture_layer_ids
    with torch.inference_mode():
        logits, captured = runner.forward_eagle3(input_ids, torch.ones_like(input_ids))
    if tuple(logits.shape) != (1, CANARY_TOKENS, vocab_size):
        raise CanaryError(
            f"canary logits have shape {tuple(logits.shape)}, expected (1, {CANARY_TOKENS}, {vocab_size})"
        )
    expected = (1, CANARY_TOKENS, len(layers) * hidden_size)
    if tuple(captured.shape) != expected:
        raise CanaryError(f"canary captured layers have shape {tuple(captured.shape)}, expected {expected}")
    if not bool(torch.isfinite(logits).all()) or not bool(torch.isfinite(captured).all()):
        raise CanaryError("canary forward produced non-finite values")
    for layer_id, layer in zip(layers, captured.split(hidden_size, dim=-1), strict=True):
        if not bool(layer.any()):
            raise CanaryError(f"canary captured layer {layer_id} is all zeros")


def plan_layers(settings: ServerSettings) -> tuple[list[int], list[int]]:
    """The (aux, capture) layer ids to serve, checked against the model's depth before anything loads."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(
        settings.model, local_files_only=True, trust_remote_code=settings.trust_remote_code
    )
    num_layers = int(text_config(config).num_hidden_layers)
    try:
        return capture_plan(num_layers, settings.aux_layer_ids, settings.capture_layer_ids)
    except ValueError as exc:
        raise LoadFailed(
            f"the layer ids do not fit this model: {exc}; fix --aux-layer-ids / --capture-layer-ids "
            "(spec.auxLayerIds / spec.captureLayerIds)"
        ) from None


def load_target(settings: ServerSettings, tracker: LoadTracker | None = None) -> LoadedTarget:
    """Check what can be refused at once, wait for weights still arriving, load the runner, run the canary
    and compute the published identity, reporting each phase to `tracker`. Slow: runs off the event loop.
    Raises LoadFailed (or the engine's own error) when the model cannot be served."""
    tracker = tracker or LoadTracker()
    kwargs = engine_kwargs(settings)
    preflight(settings.model, settings.engine, kwargs)
    wait_for_weights(Path(settings.model), tracker)
    aux_ids, capture_ids = plan_layers(settings)
    message = ENGINES[settings.engine].loading_message
    tracker.update(LoadPhase.LOADING, message)
    with weight_loading_progress(tracker, message):
        runner = load_runner(
            settings.engine,
            settings.model,
            dtype=settings.dtype,
            capture_layer_ids=capture_ids,
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
    fingerprint = model_fingerprint(
        settings.model,
        model_name=settings.display_name,
        revision=settings.revision,
        dtype=dtype_name,
        engine=settings.engine,
        aux_layer_ids=aux_ids,
        capture_layer_ids=capture_ids,
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
        capture_layer_ids=capture_ids,
        fingerprint=fingerprint,
        formats=list(SERVED_FORMATS),
        max_batch_tokens=settings.max_batch_tokens,
        max_response_bytes=settings.response_byte_limit,
        max_model_len=int(max_len),
        version=eagle3_target.__version__,
    )
    return LoadedTarget(runner=runner, device=facts.device, info=info)
