"""The capture layout of vLLM 0.33's `extract_hidden_states` method and the checks on what it writes.

vLLM's capture id `k` is the residual stream entering decoder layer `k` (id `L`: before the final norm);
`ExampleHiddenStatesConnector` writes one safetensors file per request, in a writer thread of the engine
process, a step after the request finished. These functions map HF capture ids to vLLM's and back, wait
for a file with a bound, refuse a bad file, delete files safely, rebuild the final norm and check the
rebuilt logits against vLLM's own at startup.
"""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3_target.contract import validate_capture_layer_ids
from eagle3_target.methods import vllm_capture_ids
from eagle3_target.runners.base import ModelRefused
from eagle3_target.runners.head import TargetHead

# `VLLMRunner.capture`: one `generate` call of the prompts with these sampling parameters, each row's
# captured states (h_L in the last slot) and vLLM's output for it.
Capture = Callable[[list[list[int]], Any], Generator[tuple[Tensor, Any]]]

HIDDEN_STATES_CONNECTOR = "ExampleHiddenStatesConnector"
HIDDEN_STATES_PATH_KEY = "hidden_states_path"

# Startup check of the logits rebuild against vLLM's own logits at each prompt's last position: prompts,
# their length, the share of greedy tokens that must agree (bf16 kernels differ between the rebuild and
# vLLM, so near-ties may flip a few), how many of vLLM's top log-probabilities are compared (vLLM's default
# max_logprobs), the largest difference allowed (bf16 differences are ~0.1) and how far from 1 the scale
# between the two may be (a logit scale keeps every greedy token; `compare_logprobs`).
REBUILD_CHECK_PROMPTS = 8
REBUILD_CHECK_TOKENS = 16
REBUILD_CHECK_MIN_AGREEMENT = 0.75
REBUILD_CHECK_LOGPROBS = 20
REBUILD_CHECK_MAX_LOGPROB_DIFF = 1.0
REBUILD_CHECK_MAX_SCALE_ERROR = 0.05


def engine_capture_ids(capture_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """What the engine captures for a capture set of HF ids: their vLLM ids (`methods.vllm_capture_ids`,
    HF `a` -> `a+1`) plus `L`, the final pre-norm state the runner rebuilds the logits from, ascending.

    HF `L-1` is that same state, so it maps to `L`, captured once (vLLM dedups a repeated id and its file
    would hold one layer fewer). Ascending because native model classes write the layers ascending whatever
    the order (vLLM 0.33's `EagleModelMixin._set_aux_hidden_state_layers`) and the Transformers backend in
    the order it is given (`TransformersBase.set_aux_hidden_state_layers`): sent sorted, both write
    ascending, and the final state is the file's last slot.
    """
    ids = validate_capture_layer_ids(capture_layer_ids, num_layers)
    return sorted(set(vllm_capture_ids(ids)) | {num_layers})


def file_positions(capture_layer_ids: Sequence[int], engine_ids: Sequence[int]) -> list[int]:
    """The file slot of each HF capture id, in the capture set's order, when vLLM captured `engine_ids`
    (`engine_capture_ids`)."""
    return [list(engine_ids).index(a + 1) for a in capture_layer_ids]


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


def check_logits_rebuild(capture: Capture, head: TargetHead, max_prompt_len: int) -> None:
    """The logits rebuilt from the captured final state must be vLLM's own, in value, not only argmax.

    At each check prompt's last position vLLM samples greedily and returns its top log-probabilities
    (`logprobs_mode="raw_logprobs"`, the default: the model's logits before any sampling processing).
    A model whose final norm or head differs from the rebuild (a `(1 + w)` RMSNorm, a logit scale, a
    capture id `L` that is not the true final state) fails here, at startup, instead of serving wrong
    supervision; a scale keeps every greedy token, so the log-probabilities are compared too.
    """
    from vllm import SamplingParams

    gen = torch.Generator().manual_seed(0)
    length = min(REBUILD_CHECK_TOKENS, max_prompt_len)
    prompts = torch.randint(0, head.config.vocab_size, (REBUILD_CHECK_PROMPTS, length), generator=gen)
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, logprobs=REBUILD_CHECK_LOGPROBS)
    agreeing = 0
    rebuilt: list[Tensor] = []
    engine: list[Tensor] = []
    with contextlib.closing(capture(prompts.tolist(), params)) as captures:
        for states, completion in captures:
            last = states[-1:, -1].to(device=head.norm.device, dtype=head.norm.dtype)  # h_L: the last slot
            normed = rms_norm(last, head.norm, head.config.rms_norm_eps)
            logits = F.linear(normed, head.lm_head)[0].float()
            agreeing += int(logits.argmax().item() == completion.token_ids[0])
            top = completion.logprobs[0]
            rebuilt.append(torch.log_softmax(logits, dim=-1)[list(top)].cpu())
            engine.append(torch.tensor([lp.logprob for lp in top.values()], dtype=torch.float64))
    scale, max_diff = compare_logprobs(rebuilt, engine)
    if (
        agreeing < REBUILD_CHECK_MIN_AGREEMENT * REBUILD_CHECK_PROMPTS
        or max_diff > REBUILD_CHECK_MAX_LOGPROB_DIFF
        or abs(scale - 1) > REBUILD_CHECK_MAX_SCALE_ERROR
    ):
        raise ModelRefused(
            "the logits rebuilt from vLLM's captured final hidden state are not vLLM's own: they pick "
            f"vLLM's greedy token for {agreeing} of {REBUILD_CHECK_PROMPTS} prompts (at least "
            f"{REBUILD_CHECK_MIN_AGREEMENT:.0%} needed), their log-probabilities differ from vLLM's by "
            f"up to {max_diff:.3f} (at most {REBUILD_CHECK_MAX_LOGPROB_DIFF} allowed), and vLLM's logits "
            f"are {scale:.3f} times the rebuilt ones (1 ± {REBUILD_CHECK_MAX_SCALE_ERROR} allowed): this "
            "model's final norm or LM head is not the Llama-style one the vLLM runner reproduces; use "
            "--engine hf"
        )
