"""What an engine shows the vLLM runner, observed the same way on the vLLM stand-in (`support.fake_vllm`) and
on real vLLM (its CPU build), so a test can hold the stand-in's claims to what real vLLM does.

Each observation takes a tiny checkpoint and a capture directory and returns plain JSON. It imports `vllm`
when it runs: in a test with the stand-in installed that is the stand-in; run as
`python -m support.vllm_observations NAME MODEL_DIR CAPTURE_DIR` it is the real one, in a fresh process
(an in-process engine, or several engines, would leave real vLLM's state in the test process).
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

# Capture ids sent unsorted on purpose: the file order is what is observed.
CAPTURE_IDS = [6, 1, 4, 8]
PROMPTS = [[3, 14, 15, 92, 65], [2, 71, 82, 81, 82, 84, 59, 4, 5]]
# vLLM's request ids are its counter plus a random suffix (`InputProcessor.assign_request_id`).
CAPTURE_FILE_NAME = re.compile(r"^\d+-[0-9a-f]+\.safetensors$")
LATE_FILE_WAIT_S = 2.0
# How an engine start's error is classed (pydantic's ValidationError is a ValueError).
ERROR_FAMILIES = (TypeError, ValueError, AssertionError, RuntimeError)


def engine_kwargs(storage: Path, capture_ids: list[int], **overrides: Any) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments for a capture into `storage` (the runner's configs, small and eager)."""
    return {
        "dtype": "float32",
        "skip_tokenizer_init": True,
        "enable_prefix_caching": False,
        "enforce_eager": True,
        "max_model_len": 64,
        "kv_cache_memory_bytes": 2**24,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": capture_ids}},
        },
        "kv_transfer_config": {
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        },
    } | overrides


def engine_start_errors(model_dir: Path, storage: Path) -> dict[str, list[str]]:
    """For each configuration the engine refuses before it runs: the error's class and message."""
    from vllm import LLM

    no_role = engine_kwargs(storage, CAPTURE_IDS)
    no_role["kv_transfer_config"] = {"kv_connector": "ExampleHiddenStatesConnector"}
    cases = {
        "unknown argument": engine_kwargs(storage, CAPTURE_IDS, max_num_seq=4),
        "connector without a role": no_role,
        "no capture ids": engine_kwargs(storage, []),
        "model_impl=transformers": engine_kwargs(storage, CAPTURE_IDS, model_impl="transformers"),
    }
    seen: dict[str, list[str]] = {}
    for case, kwargs in cases.items():
        try:
            engine = LLM(str(model_dir), **kwargs)
        except (TypeError, ValueError, AssertionError, RuntimeError) as error:
            family = next(
                c for c in (TypeError, ValueError, AssertionError, RuntimeError) if isinstance(error, c)
            )
            seen[case] = [family.__name__, str(error)]
        else:
            engine.llm_engine.engine_core.shutdown()
            seen[case] = ["started", ""]
    return seen


def wait_unlocked(path: Path, timeout_s: float = 60.0) -> None:
    """Until the connector's writer of `path` has released its lock."""
    deadline = time.monotonic() + timeout_s
    with open(f"{path}.lock") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path} is still being written") from None
                time.sleep(0.01)


def nearest_layers(states: torch.Tensor, prompt: list[int], model: Any) -> list[int]:
    """For each file slot, the HF residual stream it holds: k < L is `hidden_states[k]`, L the final norm's
    input (the pre-norm state)."""
    pre_norm: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_pre_hook(lambda _m, args: pre_norm.append(args[0]))
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_hidden_states=True)
    hook.remove()
    layers = model.config.num_hidden_layers
    candidates = [out.hidden_states[k][0] for k in range(layers)] + [pre_norm[0][0]]

    def distance(slot: int, layer: int) -> float:
        return float((states[:, slot] - candidates[layer]).abs().max())

    return [min(range(layers + 1), key=functools.partial(distance, slot)) for slot in range(states.shape[1])]


def capture_layout(model_dir: Path, storage: Path) -> dict[str, Any]:
    """The files one `generate` call leaves: names, tensors and layer order, as the engine wrote them."""
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    engine = LLM(str(model_dir), **engine_kwargs(storage, CAPTURE_IDS))
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        outputs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        paths = [Path(out.kv_transfer_params["hidden_states_path"]) for out in outputs]
        for path in paths:
            wait_unlocked(path)
    finally:
        engine.llm_engine.engine_core.shutdown()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    files = [load_file(path) for path in paths]
    pairs = list(zip(files, PROMPTS, strict=True))
    return {
        "names_match": all(CAPTURE_FILE_NAME.match(path.name) for path in paths),
        "in_storage": all(path.parent == storage for path in paths),
        "locks": all(Path(f"{path}.lock").exists() for path in paths),
        "tensors": [{name: [str(t.dtype), list(t.shape)] for name, t in sorted(f.items())} for f in files],
        "token_ids_are_prompts": [f["token_ids"].tolist() == p for f, p in pairs],
        "slot_layers": [nearest_layers(f["hidden_states"], p, model) for f, p in pairs],
    }


def in_process_late_files(model_dir: Path, storage: Path) -> dict[str, bool]:
    """With vLLM's in-process engine: whether a batch's file exists once `generate` has returned (and a
    while later), and once the next `generate` has run."""
    from vllm import LLM, SamplingParams

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    engine = LLM(str(model_dir), **engine_kwargs(storage, CAPTURE_IDS))
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        first = engine.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
        path = Path(first[0].kv_transfer_params["hidden_states_path"])
        after_generate = path.exists()
        time.sleep(LATE_FILE_WAIT_S)
        a_while_later = path.exists()
        engine.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)
        if Path(f"{path}.lock").exists():
            wait_unlocked(path)
        after_next_generate = path.exists()
    finally:
        engine.llm_engine.engine_core.shutdown()
    return {
        "after_generate": after_generate,
        "a_while_later": a_while_later,
        "after_next_generate": after_next_generate,
    }


OBSERVATIONS: dict[str, Callable[[Path, Path], Any]] = {
    "engine_start_errors": engine_start_errors,
    "capture_layout": capture_layout,
    "in_process_late_files": in_process_late_files,
}


def main() -> None:
    name, model_dir, storage = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    print(json.dumps(OBSERVATIONS[name](model_dir, storage)))


if __name__ == "__main__":  # vLLM's CPU platform spawns its processes: they import this module again
    main()
