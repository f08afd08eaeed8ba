"""The Hugging Face engine: a local causal LM run in-process, its capture set taken with forward hooks.

This is the reference NeMo's co-located backend defines (layer id i = output of decoder layer i = HF
`hidden_states[i+1]`, except that id L-1 is taken before the final norm; logits from the model's own
lm_head); it runs anywhere, CPU included.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from eagle3_target.contract import default_aux_layer_ids, validate_capture_layer_ids
from eagle3_target.runners.base import (
    ForwardHiddenUnsupported,
    ModelRefused,
    check_inputs,
    logit_transform,
    parse_dtype,
    process_lost,
    text_config,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _first_attr(owner: nn.Module, names: Sequence[str], what: str) -> Any:
    for name in names:
        found = getattr(owner, name, None)
        if found is not None:
            return found
    raise ValueError(f"cannot find the {what} of {type(owner).__name__} (looked for {', '.join(names)})")


class HFRunner:
    """A frozen HF causal LM implementing `TargetRunner`.

    Forwards run under `torch.no_grad` rather than `inference_mode`: the outputs may feed an in-process
    trainer, and inference tensors cannot be saved for backward there.
    """

    def __init__(self, model: PreTrainedModel, capture_layer_ids: Sequence[int] | None = None) -> None:
        self.model = model.eval().requires_grad_(False)
        self._config = text_config(model.config)
        self._decoder: nn.Module = model.get_decoder()
        self._layers: list[nn.Module] = list(_first_attr(self._decoder, ("layers", "h"), "decoder layers"))
        self._final_norm: nn.Module = _first_attr(
            self._decoder, ("norm", "final_layernorm", "ln_f"), "final norm"
        )
        num_layers = int(self._config.num_hidden_layers)
        if len(self._layers) != num_layers:
            raise ValueError(f"config says {num_layers} layers but the model has {len(self._layers)}")
        self.capture_layer_ids: list[int] = []
        self._failure: str | None = None
        self.set_capture_layers(
            default_aux_layer_ids(num_layers) if capture_layer_ids is None else capture_layer_ids
        )

    @classmethod
    def from_pretrained(
        cls,
        model_path: str | os.PathLike[str],
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        capture_layer_ids: Sequence[int] | None = None,
        trust_remote_code: bool = False,
    ) -> HFRunner:
        """Load a local model directory (sharded or not); device defaults to CUDA when available."""
        from transformers import AutoModelForCausalLM

        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise ModelRefused(f"{path} is not a local model directory (no config.json)")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=parse_dtype(dtype),
            local_files_only=True,
            trust_remote_code=trust_remote_code,
        )
        return cls(model.to(device), capture_layer_ids)

    def set_capture_layers(self, capture_layer_ids: Sequence[int]) -> None:
        self.capture_layer_ids = validate_capture_layer_ids(capture_layer_ids, len(self._layers))

    def forward_eagle3(
        self, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        def run(ids: Tensor, mask: Tensor) -> Tensor:
            return self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits

        logits, captured = self._run_capturing(run, input_ids, attention_mask, self.capture_layer_ids)
        return logits, self._concat(captured)

    def forward_hidden(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, *, prenorm: bool = False
    ) -> tuple[Tensor, Tensor]:
        # Read per call, not at load: the config is the model's own, which its owner may still change.
        field = None if prenorm else logit_transform(self._config)
        if field is not None:
            raise ForwardHiddenUnsupported(f"this model's logits apply {field}; use forward_eagle3 for it")

        def run(ids: Tensor, mask: Tensor) -> Tensor:
            # The decoder alone stops at final_norm(h_L): no [B, S, V] logits are ever allocated.
            return self._decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state

        # h_L is the last decoder layer's output, the tensor the decoder hands its final norm.
        last = len(self._layers) - 1
        layer_ids = [*self.capture_layer_ids, last] if prenorm else self.capture_layer_ids
        final, captured = self._run_capturing(run, input_ids, attention_mask, layer_ids)
        return (captured[last] if prenorm else final), self._concat(captured)

    def _run_capturing(
        self,
        run: Callable[[Tensor, Tensor], Tensor],
        input_ids: Tensor,
        attention_mask: Tensor | None,
        layer_ids: Sequence[int],
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """`run` on the checked batch, with the outputs of the decoder layers `layer_ids` captured."""
        ids, mask = check_inputs(input_ids, attention_mask, int(self._config.vocab_size))
        device = self.input_embedding_weight().device
        captured: dict[int, Tensor] = {}

        def hook_for(layer_id: int) -> Callable[..., None]:
            def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
                captured[layer_id] = output[0] if isinstance(output, tuple) else output

            return hook

        wanted = sorted(set(layer_ids))
        handles = [self._layers[i].register_forward_hook(hook_for(i)) for i in wanted]
        try:
            with torch.no_grad():
                main = run(ids.to(device), mask.to(device))
        except Exception as exc:
            if process_lost(exc):
                self._failure = f"the model lost its device: {type(exc).__name__}: {exc}"
            raise
        finally:
            for handle in handles:
                handle.remove()
        if sorted(captured) != wanted:
            raise RuntimeError(f"captured layers {sorted(captured)}, expected {wanted}")
        return main, captured

    def _concat(self, captured: dict[int, Tensor]) -> Tensor:
        return torch.cat([captured[i] for i in self.capture_layer_ids], dim=-1)

    def input_embedding_weight(self) -> Tensor:
        return self.model.get_input_embeddings().weight.detach()

    def lm_head_weight(self) -> Tensor:
        head = self.model.get_output_embeddings()
        return (head if head is not None else self.model.get_input_embeddings()).weight.detach()

    def final_norm_weight(self) -> Tensor:
        weight = self._final_norm.weight
        assert isinstance(weight, Tensor)  # a norm's weight is a parameter, not a submodule
        return weight.detach()

    @property
    def failure(self) -> str | None:
        return self._failure

    def close(self) -> None:
        """Drop the model; the memory returns once the last reference goes."""
        self.model = self.model.to("meta")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
