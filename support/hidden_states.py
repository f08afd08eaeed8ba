"""What transformers itself computes for a batch, the reference every engine's captured layers are checked
against: layer id i is `output_hidden_states[i + 1]`, except the last decoder layer (L-1), whose output is
h_L before the final norm (transformers hands back its last hidden state after the norm, so L-1 is read
with a forward hook; `hidden_states[L]` is the post-norm final state)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel


@dataclass(frozen=True)
class TransformersStates:
    """Each decoder layer's output (L-1 before the final norm), the post-norm final state and the logits."""

    layers: dict[int, Tensor]
    postnorm: Tensor
    logits: Tensor

    @property
    def prenorm(self) -> Tensor:
        return self.layers[len(self.layers) - 1]

    def captured(self, layer_ids: list[int]) -> Tensor:
        """The layers concatenated in that order, as a capture set's tensor is."""
        return torch.cat([self.layers[i] for i in layer_ids], dim=-1)


def transformers_states(model: PreTrainedModel, input_ids: Tensor, mask: Tensor) -> TransformersStates:
    num_layers = model.config.num_hidden_layers
    kept: list[Tensor] = []
    hook = model.model.layers[num_layers - 1].register_forward_hook(
        lambda _module, _inputs, output: kept.append(output[0] if isinstance(output, tuple) else output)
    )
    try:
        with torch.no_grad():
            out = model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    finally:
        hook.remove()
    states = out.hidden_states
    assert len(states) == num_layers + 1 and len(kept) == 1
    layers = {i: states[i + 1] for i in range(num_layers - 1)} | {num_layers - 1: kept[0]}
    return TransformersStates(layers, states[num_layers], out.logits)
