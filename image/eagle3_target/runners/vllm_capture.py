"""The capture layout of vLLM 0.33's `extract_hidden_states` method and the checks on what it writes.

vLLM's capture id `k` is the residual stream entering decoder layer `k` (id `L`: before the final norm);
`ExampleHiddenStatesConnector` writes one safetensors file per request, layers ascending. These functions
map HF aux ids to capture ids and back, refuse a bad file, delete files safely and rebuild the final norm.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from eagle3_target.contract import validate_aux_layer_ids

HIDDEN_STATES_CONNECTOR = "ExampleHiddenStatesConnector"
HIDDEN_STATES_PATH_KEY = "hidden_states_path"


def capture_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """vLLM capture ids for HF aux ids: id `k` is the residual entering layer `k`, so HF `a` -> `a+1`; plus L.

    Aux id `L-1` would capture `L`, the final pre-norm state asked for separately; vLLM dedups the ids and
    the file would hold one layer fewer, so it is refused.
    """
    ids = validate_aux_layer_ids(aux_layer_ids, num_layers)
    if num_layers - 1 in ids:
        raise ValueError(
            f"aux layer id {num_layers - 1} (the last decoder layer) is not supported by the vLLM engine: "
            f"its capture id {num_layers} is the final pre-norm hidden state the runner already captures"
        )
    return [a + 1 for a in ids] + [num_layers]


def file_positions(capture_ids: Sequence[int]) -> list[int]:
    """Index of each capture id in vLLM's file, which holds the layers ascending (`tuple(sorted(set(ids)))`
    in `EagleModelMixin._set_aux_hidden_state_layers`, vllm/model_executor/models/interfaces.py)."""
    ascending = sorted(capture_ids)
    return [ascending.index(i) for i in capture_ids]


def rms_norm(hidden: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The final RMSNorm exactly as transformers' Llama/Qwen3 RMSNorm computes it (fp32 statistics)."""
    x = hidden.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(hidden.dtype)


def check_capture(
    row: int, data: Mapping[str, Tensor], prompt: list[int], num_captures: int, hidden: int
) -> Tensor:
    """Refuse a capture that would make wrong supervision: wrong shape/length, foreign tokens, zeros, NaN/inf.

    All-zero layers are what vLLM 0.24 silently wrote for hybrid models (vllm PR #46301); a length mismatch
    is what prefix caching produced in vllm issue #44485.
    """
    states = data["hidden_states"]
    token_ids = data["token_ids"]
    if states.dim() != 3 or tuple(states.shape[1:]) != (num_captures, hidden):
        raise RuntimeError(
            f"row {row}: captured hidden_states has shape {tuple(states.shape)}, expected "
            f"[seq, {num_captures}, {hidden}]"
        )
    if states.shape[0] != len(prompt) or token_ids.numel() != len(prompt):
        raise RuntimeError(
            f"row {row}: vLLM captured {states.shape[0]} positions ({token_ids.numel()} token ids) for a "
            f"{len(prompt)}-token prompt"
        )
    if token_ids.tolist() != prompt:
        raise RuntimeError(f"row {row}: the captured token_ids differ from the prompt that was sent")
    if not torch.isfinite(states).all():
        raise RuntimeError(f"row {row}: vLLM captured non-finite (NaN/inf) hidden states")
    zero_layers = (states == 0).flatten(start_dim=2).all(dim=2).all(dim=0).nonzero().flatten().tolist()
    if zero_layers:
        raise RuntimeError(f"row {row}: vLLM captured all-zero hidden states at file slot(s) {zero_layers}")
    return states


def discard_capture(path: str) -> None:
    """Delete a capture file without reading it, once its writer has finished.

    The connector writes asynchronously while holding LOCK_EX on `path + ".lock"` (created before the path
    is returned); deleting before the write ends would let the file reappear afterwards and stay in memory.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
    )

    with contextlib.suppress(FileNotFoundError), open(path + ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
    cleanup_hidden_states(path)
