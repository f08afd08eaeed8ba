"""The half of a runner that vLLM and SGLang share: the model runs out of reach (in vLLM's engine process,
across SGLang's tensor-parallel ranks), so the output-side weights are read from the checkpoint into a
`TargetHead`, the logits are rebuilt as lm_head(final_norm(h_L)), and a ragged batch goes to the engine as
its rows' real tokens and comes back packed end to end. An engine runner subclasses `RebuiltHeadRunner`
and adds loading, `set_capture_layers` and `forward_hidden`.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, PretrainedConfig

from eagle3_target.runners.base import InvalidInput, check_inputs, text_config
from eagle3_target.runners.checkpoint import HeadWeights, load_head_weights


class TargetHead(nn.Module):
    """The runner's `model`: the config plus the frozen output-side weights held outside the engine.

    The real model lives in the engine; callers only need `.config` and `.parameters()` (for the device
    and dtype), which this gives them with weights that exist (the engine's own copies may be sharded).
    """

    def __init__(self, config: PretrainedConfig, weights: HeadWeights) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Parameter(weights.input_embeddings, requires_grad=False)
        self.norm = nn.Parameter(weights.final_norm, requires_grad=False)
        self.lm_head = nn.Parameter(weights.lm_head, requires_grad=False)

    @classmethod
    def load(
        cls,
        model_path: str | os.PathLike[str],
        config: PretrainedConfig,
        dtype: torch.dtype,
        device: torch.device,
    ) -> TargetHead:
        """The head of the checkpoint at `model_path` whose (text) config is `config`."""
        weights = load_head_weights(
            os.fspath(model_path),
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            dtype=dtype,
            device=device,
        )
        return cls(config, weights)


def read_config(model_path: str | os.PathLike[str], trust_remote_code: bool) -> tuple[Any, PretrainedConfig]:
    """(the checkpoint's config, its language-model part)."""
    full_config = AutoConfig.from_pretrained(os.fspath(model_path), trust_remote_code=trust_remote_code)
    return full_config, text_config(full_config)


def resolve_device(device: torch.device | str | None) -> torch.device:
    """Where the head lives: as asked, else CUDA when there is one."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


@dataclass(frozen=True)
class Rows:
    """A checked right-padded batch as an engine takes it: each row's real tokens."""

    shape: tuple[int, int]
    lengths: list[int]
    prompts: list[list[int]]

    def unpack(self, packed: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
        """[tokens, X] (the rows end to end) -> [B, S, X], zeros at the padding."""
        out = torch.zeros(*self.shape, packed.shape[-1], dtype=dtype, device=device)
        start = 0
        for r, n in enumerate(self.lengths):
            out[r, :n] = packed[start : start + n].to(device=device, dtype=dtype)
            start += n
        return out


class RebuiltHeadRunner(ABC):
    """`TargetRunner` surface of an engine whose logits are rebuilt from the captured final state."""

    #: The engine's name and why its longest row is `max_prompt_len`, for the refusal of a longer one.
    ENGINE: ClassVar[str]
    PROMPT_LIMIT: ClassVar[str]

    _config: PretrainedConfig
    _device: torch.device
    _head: TargetHead | None
    _capture_layer_ids: list[int]

    @property
    def model(self) -> TargetHead:
        assert self._head is not None, "the head is loaded once the engine has started"
        return self._head

    @property
    def capture_layer_ids(self) -> list[int]:
        return list(self._capture_layer_ids)

    @property
    @abstractmethod
    def max_prompt_len(self) -> int:
        """Longest row the engine takes."""

    @abstractmethod
    def set_capture_layers(self, capture_layer_ids: Sequence[int]) -> None: ...

    @abstractmethod
    def forward_hidden(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, *, prenorm: bool = False
    ) -> tuple[Tensor, Tensor]: ...

    def forward_eagle3(
        self, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(logits [B,S,V] = lm_head(final_norm(h_L)), captured [B,S,n*H]) unshifted."""
        final, captured = self.forward_hidden(input_ids, attention_mask)
        return F.linear(final, self.model.lm_head), captured

    def input_embedding_weight(self) -> Tensor:
        return self.model.embed_tokens.detach()

    def lm_head_weight(self) -> Tensor:
        return self.model.lm_head.detach()

    def final_norm_weight(self) -> Tensor:
        return self.model.norm.detach()

    def rows(self, input_ids: Tensor, attention_mask: Tensor | None) -> Rows:
        """The checked batch's rows, refused when one is longer than the engine takes."""
        ids, mask = check_inputs(input_ids, attention_mask, self._config.vocab_size)
        lengths = mask.sum(dim=1).tolist()
        if max(lengths) > self.max_prompt_len:
            raise InvalidInput(
                f"a row has {max(lengths)} tokens; the {self.ENGINE} engine takes at most "
                f"{self.max_prompt_len} ({self.PROMPT_LIMIT})"
            )
        prompts = [ids[r, :n].tolist() for r, n in enumerate(lengths)]
        return Rows((ids.shape[0], ids.shape[1]), lengths, prompts)

    def unpack(self, rows: Rows, packed: Tensor) -> Tensor:
        """`rows.unpack` in the head's dtype, on its device."""
        return rows.unpack(packed, self.model.norm.dtype, self._device)
