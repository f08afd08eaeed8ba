"""The engine seam: what every engine's runner (HF, vLLM, SGLang) provides to the server.

The supervision contract and the server depend only on this protocol, so engines stay swappable and the
contract is testable without any engine installed. It captures a capture set, any layers, where NeMo's
runner surface (which `client.runner_adapter` gives a remote target) captures exactly the three aux layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor


class InvalidInput(ValueError):
    """A batch refused for what the caller sent (shape, dtype, token ids, padding, length). The server
    answers it with 422; any other exception from a runner is a server fault (500)."""


class ModelRefused(ValueError):
    """An engine will not load this model with these arguments (an unknown engine argument, an architecture
    or config it cannot serve exactly). Loading again cannot change the answer, so the server ends with the
    message: it says what is wrong and what to do."""


class ForwardHiddenUnsupported(ValueError):
    """`forward_hidden` refuses: this model's logits are not lm_head(final_norm(h_L)) (a softcap, a logit
    scale), so only `forward_eagle3` gives them exactly. Callers that can take full logits fall back.
    The pre-norm h_L claims nothing about the logits and is never refused."""


@runtime_checkable
class TargetRunner(Protocol):
    """A frozen target LLM that returns the hidden states of its capture set: the decoder layers it was
    loaded to capture, in that order (the EAGLE-3 aux layers by default). All outputs are unshifted
    (position-aligned)."""

    @property
    def model(self) -> Any:
        """Exposes .config (num_hidden_layers, hidden_size, vocab_size) and .parameters()."""

    @property
    def capture_layer_ids(self) -> list[int]:
        """The captured decoder layers, in the order of the captured tensor (HF ids: output of decoder
        layer i; L-1 is the last hidden state before the final norm)."""
        ...

    def set_capture_layers(self, capture_layer_ids: Sequence[int]) -> None:
        """Capture these layers from now on (`contract.validate_capture_layer_ids`)."""
        ...

    def forward_eagle3(
        self, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(logits [B,S,V], captured [B,S,n*H]) in the model dtype."""
        ...

    def forward_hidden(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, *, prenorm: bool = False
    ) -> tuple[Tensor, Tensor]:
        """(final_norm(h_L) [B,S,H], captured [B,S,n*H]) in the model dtype, without materialising full
        logits.

        With `prenorm`, h_L itself: the last decoder layer's output before the final norm (for trainers
        that apply the target's norm themselves, like speculators)."""
        ...

    def input_embedding_weight(self) -> Tensor:
        """[V, H]."""
        ...

    def lm_head_weight(self) -> Tensor:
        """[V, H]; the input embeddings for models with tied embeddings."""
        ...

    def final_norm_weight(self) -> Tensor:
        """[H]."""
        ...

    @property
    def failure(self) -> str | None:
        """Why the engine can run no more batches (a worker process died, the device was lost), or None
        while it can. A failed batch is that batch's error; this is for the engine itself: the server turns
        unready and exits on it, so that Kubernetes restarts the pod."""
        ...

    def close(self) -> None:
        """Release the engine (GPU memory, worker processes)."""
        ...


def process_lost(exc: BaseException) -> bool:
    """Whether `exc` leaves this process unable to run another batch: a CUDA error other than running out
    of memory (a device-side assert, an illegal address) poisons the CUDA context for good."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    return isinstance(exc, torch.AcceleratorError) or "CUDA error" in str(exc)


def parse_positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"expected a positive integer, got {text!r}")
    return value


def parse_max_batch_tokens(value: int | str | None) -> int | None:
    """The server's --max-batch-tokens as a runner takes it (a script may pass a string), or None: refused
    before anything loads, since the engine is sized by it and checked against it once loaded."""
    try:
        return None if value is None else parse_positive_int(str(value))
    except ValueError as exc:
        raise ModelRefused(f"max_batch_tokens={value!r}: {exc}") from None


def refuse_batches_beyond_cache(max_batch_tokens: int | None, cache_tokens: int, grow: str) -> None:
    """Refuse, at load, a `max_batch_tokens` the engine's KV cache cannot hold at once: such a batch would
    fail in the engine (SGLang's "Prefill out of memory") or be split and preempted (vLLM's scheduler), after
    the server had accepted it. `grow` says how to give this engine's cache more memory."""
    if max_batch_tokens is not None and max_batch_tokens > cache_tokens:
        raise ModelRefused(
            f"--max-batch-tokens {max_batch_tokens} is more than the engine's KV cache holds ({cache_tokens} "
            f"tokens): set --max-batch-tokens {cache_tokens} or less, or {grow}"
        )


@dataclass(frozen=True)
class ModelInfo:
    """The target's shape facts that the server publishes and clients check against their draft."""

    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> str | torch.dtype:
    """Map a user dtype ("auto", "bfloat16", "bf16", torch.float32, ...) to what transformers accepts."""
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected 'auto' or one of {sorted(_DTYPES)}") from None


# Config fields that change the logits after lm_head(final_norm(h_L)), each with the value that leaves them
# unchanged (a string names the config field whose value that is). Engines that rebuild logits from the
# final hidden state must refuse a model that sets one. Scales keep the argmax, so only a rule catches them.
LOGIT_TRANSFORMS: dict[str, float | str | None] = {
    "final_logit_softcapping": None,  # Gemma 2: cap * tanh(logits / cap)
    "logit_scale": 1.0,  # Cohere, MPT: logits * scale
    "logits_scaling": 1.0,  # Granite: logits / scaling
    "output_multiplier": 1.0,  # MuseGlimmer (as vLLM computes it): logits * multiplier
    "dim_model_base": "hidden_size",  # MiniCPM (as vLLM computes it): lm_head(final_norm(h) * base / hidden)
}


def logit_transform(config: Any) -> str | None:
    """The first config field by which this model's logits are more than lm_head(final_norm(h_L)), or None."""
    for field, identity in LOGIT_TRANSFORMS.items():
        value = getattr(config, field, None)
        unchanged = getattr(config, identity, None) if isinstance(identity, str) else identity
        if value is not None and value != unchanged:
            return field
    return None


def text_config(config: Any) -> Any:
    """The language-model part of a config (multimodal wrappers keep it under `text_config`)."""
    inner = getattr(config, "text_config", None)
    return inner if inner is not None and getattr(inner, "num_hidden_layers", None) is not None else config


def model_info(runner: TargetRunner) -> ModelInfo:
    """Read num layers/hidden/vocab from the runner's config, dtype/device from its parameters."""
    config = text_config(runner.model.config)
    first = next(iter(runner.model.parameters()))
    return ModelInfo(
        num_hidden_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        dtype=first.dtype,
        device=first.device,
    )


def check_inputs(input_ids: Tensor, attention_mask: Tensor | None, vocab_size: int) -> tuple[Tensor, Tensor]:
    """Validate a batch before it reaches an engine; returns int64 (input_ids, attention_mask).

    Checking token ids here matters: an out-of-range id is an IndexError on CPU but a device-side assert
    that kills the whole CUDA context on GPU. Rows must be right-padded (mask 1...1 0...0, first token
    real) because the runners compute positions from 0 and NeMo's data pipeline pads on the right.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise InvalidInput(f"input_ids must be a non-empty [B, S] tensor, got shape {tuple(input_ids.shape)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise InvalidInput(f"input_ids must be integers, got {input_ids.dtype}")
    ids = input_ids.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise InvalidInput(
            f"token ids must lie in [0, {vocab_size}), got [{int(ids.min())}, {int(ids.max())}]"
        )
    if attention_mask is None:
        return ids, torch.ones_like(ids)
    if tuple(attention_mask.shape) != tuple(ids.shape):
        raise InvalidInput(
            f"attention_mask shape {tuple(attention_mask.shape)} != input_ids {tuple(ids.shape)}"
        )
    if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
        raise InvalidInput(f"attention_mask must be integer or bool, got {attention_mask.dtype}")
    mask = attention_mask.long()
    if bool(((mask != 0) & (mask != 1)).any()):
        raise InvalidInput("attention_mask must hold only 0 and 1")
    if bool((mask[:, 0] == 0).any()) or bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise InvalidInput("rows must be right-padded: attention_mask 1...1 0...0 with a real first token")
    return ids, mask
