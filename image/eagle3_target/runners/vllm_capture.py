"""The capture layout of vLLM 0.33's `extract_hidden_states` method and the checks on what it writes.

vLLM's capture id `k` is the residual stream entering decoder layer `k` (id `L`: before the final norm);
`ExampleHiddenStatesConnector` writes one safetensors file per request, in a writer thread of the engine
process, a step after the request finished. These functions map HF aux ids to capture ids and back, wait
for a file with a bound, refuse a bad file, delete files safely and rebuild the final norm and logprobs.
"""

from __future__ import annotations

import fcntl
import time
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
    """Index of each capture id in vLLM's file when the engine was given the ids ascending.

    Native model classes store the ids sorted (vLLM 0.33's `EagleModelMixin._set_aux_hidden_state_layers`);
    the Transformers backend keeps the order it is given (`TransformersBase.set_aux_hidden_state_layers`).
    The runner sends them sorted, so both write ascending.
    """
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


def wait_for_write(path: str, timeout_s: float) -> bool:
    """Whether the connector's writer of `path` has finished, waiting at most `timeout_s`.

    The writer holds LOCK_EX on `path + ".lock"` from the step that scheduled the request until its
    `save_file` returns. vLLM's own `load_hidden_states` blocks on that lock without a bound, which would
    hang a request (and the server's worker) forever if a write never ends; this polls instead.
    """
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    try:
        with open(path + ".lock") as lock:
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    return True  # closing the file releases the shared lock
                except BlockingIOError:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    time.sleep(min(pause, left))
                    pause = min(2 * pause, 0.05)
    except FileNotFoundError:
        return True  # no lock: nothing is being written


def read_capture(row: int, path: str, timeout_s: float) -> dict[str, Tensor]:
    """One request's capture file, read once its write has ended; a clear error when it does not end or
    did not happen (vLLM only logs a failed write and releases the lock: `_on_write_done`)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        load_hidden_states,
    )

    if not wait_for_write(path, timeout_s):
        raise RuntimeError(
            f"row {row}: vLLM's connector did not finish writing {path} within {timeout_s:g} s (is the "
            "engine process alive? see its log)"
        )
    try:
        return load_hidden_states(path)
    except OSError as exc:
        raise RuntimeError(
            f"row {row}: vLLM's connector wrote no capture file at {path} (its write failed; see the engine "
            f"log): {exc}"
        ) from exc


def discard_capture(path: str, timeout_s: float) -> bool:
    """Delete a capture file and its lock once its writer has finished; False if it is still writing.

    Deleting before the write ends would let the file reappear afterwards and stay in memory, so a file
    still being written is left for a later call.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
    )

    if not wait_for_write(path, timeout_s):
        return False
    cleanup_hidden_states(path)
    return True


def compare_logprobs(rebuilt: Sequence[Tensor], engine: Sequence[Tensor]) -> tuple[float, float]:
    """(scale, max |difference|) between the rebuilt log-probabilities and vLLM's, each pair the same
    token ids of one position.

    Under a logit scale `s` the log-probabilities, centred per position, are `s` times each other, so
    `scale` is the least-squares slope of vLLM's centred values on the rebuilt ones: 1 for a faithful
    rebuild, `s` for a scale it misses, which keeps the argmax and so passes any argmax check.
    """
    ours = torch.cat([r.double() - r.double().mean() for r in rebuilt])
    theirs = torch.cat([e.double() - e.double().mean() for e in engine])
    scale = float((ours * theirs).sum() / (ours * ours).sum().clamp_min(1e-12))
    max_diff = max(float((r.double() - e.double()).abs().max()) for r, e in zip(rebuilt, engine, strict=True))
    return scale, max_diff
