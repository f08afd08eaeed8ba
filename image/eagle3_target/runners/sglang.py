"""The SGLang engine runner: supervision from SGLang 0.5.23's own model runner, in this process (or one per
tensor-parallel rank, each in a process of its own: `sglang_tp`).

One extend (prefill) forward per batch, every row its own causal sequence, with SGLang's own aux capture
(`--enable-return-aux-hidden-states`, EAGLE-3 convention: layer id i is the output of decoder layer i, the
project's) and `CaptureHiddenMode.FULL`. Two things SGLang does not hand back are taken on the way: the
logits processor computes logits only at each row's last position, so a wrapper of its `forward` keeps the
post-norm final hidden state of every position (the logits are lm_head of it, computed where a format
needs them); and h_L before the final norm, also the last layer's output (SGLang's capture cannot take it),
is the updated residual the final norm returns (a forward hook). The rank's side is `sglang_rank`, after
`sglang/benchmark/one_batch.py` of the 0.5.23 wheel (docs/sglang.md gives file:line); `sglang` is imported
lazily so the rest of the package works without it. Engine arguments and what is refused before anything
loads are in `sglang_args`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from transformers import PretrainedConfig

from eagle3_target.contract import default_aux_layer_ids, validate_capture_layer_ids
from eagle3_target.runners.base import (
    InvalidInput,
    ModelRefused,
    parse_max_batch_tokens,
    refuse_batches_beyond_cache,
)
from eagle3_target.runners.head import RebuiltHeadRunner, TargetHead, read_config, resolve_device
from eagle3_target.runners.sglang_args import (
    refuse_unsupported_model,
    server_args_for,
)
from eagle3_target.runners.sglang_rank import RankCapture, Ranks, start_model_runner, use_cpu_engine
from eagle3_target.runners.sglang_tp import RankProcesses

# SGLang builds its process groups and runtime context once a process (`bootstrap.init_parallel_runtime`
# refuses a second build), so one runner at a time: the open one, if any.
_open_runner: list[SGLangRunner] = []


def open_runners() -> list[SGLangRunner]:
    """The SGLang runners open in this process (at most one)."""
    return list(_open_runner)


class SGLangRunner(RebuiltHeadRunner):
    """`TargetRunner` over SGLang's `ModelRunner`: in this process for one rank, in one worker process per
    rank for tensor parallelism (`sglang_tp`)."""

    ENGINE = "SGLang"
    PROMPT_LIMIT = "its context length"

    def __init__(
        self,
        ranks: Ranks,
        config: PretrainedConfig,
        head: TargetHead,
        capture_layer_ids: Sequence[int],
        server_args: Any,
    ) -> None:
        self._ranks = ranks
        self._server_args = server_args
        self._config = config
        self._head = head
        self._device = head.embed_tokens.device
        self._capture_layer_ids: list[int] = []
        self.set_capture_layers(capture_layer_ids)

    @classmethod
    def from_pretrained(
        cls,
        model_path: str | os.PathLike[str],
        *,
        dtype: torch.dtype | str | None = None,
        capture_layer_ids: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        trust_remote_code: bool = False,
        max_batch_tokens: int | str | None = None,
        **engine_kwargs: object,
    ) -> SGLangRunner:
        """Load the model into SGLang's model runner (one per tensor-parallel rank). `max_batch_tokens` (the
        server's) sizes the KV cache on CPU and must fit in the one SGLang allocates; `engine_kwargs` are
        SGLang server arguments (`sglang_args.server_args_for`). Everything that can be refused is refused
        before SGLang loads, and a rank that fails to load fails the whole runner with its reason."""
        batch_tokens = parse_max_batch_tokens(max_batch_tokens)
        path = os.fspath(model_path)
        full_config, config = read_config(path, trust_remote_code)
        num_layers = config.num_hidden_layers
        ids = default_aux_layer_ids(num_layers) if capture_layer_ids is None else capture_layer_ids
        ids = validate_capture_layer_ids(ids, num_layers)
        resolved = resolve_device(device)
        use_cpu_engine(resolved)
        refuse_unsupported_model(path, full_config)
        server_args = server_args_for(
            path,
            dtype=dtype,
            device=resolved.type,
            trust_remote_code=trust_remote_code,
            max_batch_tokens=batch_tokens,
            engine_kwargs=engine_kwargs,
        )
        if _open_runner:
            raise ModelRefused(
                "an SGLang runner is already open in this process (SGLang builds its process groups once a "
                "process); close it first"
            )
        ranks: Ranks
        if server_args.tp_size > 1:
            ranks = RankProcesses.start(server_args)
        else:
            ranks = RankCapture(start_model_runner(server_args))
        try:
            refuse_batches_beyond_cache(
                batch_tokens,
                ranks.pool.tokens,
                "raise the engine argument mem_fraction_static (max_total_tokens on CPU)",
            )
            runner = cls(
                ranks, config, TargetHead.load(path, config, ranks.dtype, resolved), ids, server_args
            )
        except BaseException:
            ranks.close()
            raise
        _open_runner.append(runner)
        return runner

    # -- TargetRunner surface --

    @property
    def engine(self) -> Any:
        """SGLang's `ModelRunner`, for inspection (its `server_args` say what SGLang runs with); None when
        the ranks run in worker processes."""
        return getattr(self._ranks, "model_runner", None)

    @property
    def server_args(self) -> Any:
        """SGLang's `ServerArgs` every rank runs with (`nccl_port`: the ranks' rendezvous)."""
        return self._server_args

    def placements(self) -> list[tuple[int, int, int, list[int]]]:
        """Each rank's (tp_rank, tp_size, attention heads, SGLang's capture list), rank 0 first."""
        return self._ranks.placements()

    @property
    def max_prompt_len(self) -> int:
        """Longest row SGLang's model runner takes (its context length)."""
        return self._ranks.context_len

    @property
    def failure(self) -> str | None:
        return self._ranks.failure

    def set_capture_layers(self, capture_layer_ids: Sequence[int]) -> None:
        """Capture these layers on every rank, with no restart. SGLang captures in layer order;
        `forward_hidden` reorders."""
        ids = validate_capture_layer_ids(capture_layer_ids, self._config.num_hidden_layers)
        self._ranks.set_layers(sorted(ids))
        self._capture_layer_ids = ids

    def forward_hidden(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, *, prenorm: bool = False
    ) -> tuple[Tensor, Tensor]:
        """(final_norm(h_L) [B,S,H], captured [B,S,n*H]) unshifted; padding positions are zeros. With
        `prenorm`, h_L before the final norm."""
        rows = self.rows(input_ids, attention_mask)
        refusal = self._ranks.pool.refusal(rows.lengths)
        if refusal is not None:
            raise InvalidInput(f"{refusal}: send fewer tokens at once")
        final, captured = self._ranks.extend(rows.prompts, prenorm)
        # SGLang packs its captures in ascending layer order; put them back in the requested one.
        ids = self._capture_layer_ids
        order = [sorted(ids).index(i) for i in ids]
        captured = captured.view(captured.shape[0], len(ids), -1)[:, order].flatten(start_dim=1)
        return self.unpack(rows, final), self.unpack(rows, captured)

    def plain_prefill(self, input_ids: Tensor) -> None:
        """SGLang's own prefill of the rows (all real tokens) as its server runs one: no aux capture,
        logits at each row's last position only. The baseline the acceptance suite times the capture
        against (scripts/smoke_sglang.py)."""
        self._ranks.plain_prefill([row.tolist() for row in input_ids])

    def close(self) -> None:
        """Release the model runners and SGLang's process groups (and the rank processes)."""
        if self not in _open_runner:
            return
        _open_runner.remove(self)
        self._ranks.close()
