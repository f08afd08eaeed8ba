"""NeMo AutoModel's `TargetRunner` surface over a remote target, so a NeMo-style trainer plugs in unchanged.

NeMo wraps a runner in `RunnerEagle3TargetModel`, which calls `set_aux_layers` once, `forward_eagle3` per
batch (unshifted full logits + aux) and applies its own shift; `input_embedding_weight` seeds the draft's
embedding.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Protocol

import torch
from torch import Tensor

from eagle3_target.contract import validate_aux_layer_ids
from eagle3_target.formats import logits_from_hidden
from eagle3_target.protocol import TargetInfo


class RemoteTarget(Protocol):
    """What the adapter needs of a client (`TargetClient` is one)."""

    device: torch.device

    def info(self) -> TargetInfo: ...

    def supervise(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, format: str = ...
    ) -> dict[str, Tensor]: ...

    def weight(self, name: str) -> Tensor: ...

    def close(self) -> None: ...


class RemoteModel:
    """What NeMo reads off `runner.model`: `.config` sizes and a parameter that tells the device."""

    def __init__(self, info: TargetInfo, device: torch.device) -> None:
        self.config = SimpleNamespace(
            num_hidden_layers=info.num_hidden_layers,
            hidden_size=info.hidden_size,
            vocab_size=info.vocab_size,
            name_or_path=info.model,
        )
        self._device_marker = torch.empty(0, device=device)

    def parameters(self) -> Iterator[Tensor]:
        yield self._device_marker


class RemoteTargetRunner:
    """`TargetRunner` over a `TargetClient`: full logits are rebuilt locally from the `hidden` format."""

    def __init__(self, client: RemoteTarget) -> None:
        self.client = client
        self.model = RemoteModel(client.info(), client.device)

    def set_aux_layers(self, aux_layer_ids: Sequence[int]) -> None:
        """Check the request against what the server captures: a remote target cannot switch per client."""
        info = self.client.info()
        requested = validate_aux_layer_ids(aux_layer_ids, info.num_hidden_layers)
        served = list(info.aux_layer_ids)
        if requested != served:
            raise ValueError(
                f"the target captures aux layers {served}, not {requested}; set spec.auxLayerIds on the "
                "Eagle3Target (or --aux-layer-ids on the server) to change them"
            )

    def forward_eagle3(
        self, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(logits [B,S,V], aux [B,S,3H]), both unshifted, as an in-process runner returns them."""
        raw = self.client.supervise(input_ids, attention_mask, format="hidden")
        logits = logits_from_hidden(raw["final_hidden"], self.client.weight("lm_head"))
        return logits, raw["aux_hidden_states"]

    def input_embedding_weight(self) -> Tensor:
        return self.client.weight("input_embeddings")

    def close(self) -> None:
        self.client.close()
