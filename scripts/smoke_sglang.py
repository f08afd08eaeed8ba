"""GPU acceptance of the SGLang engine: its EAGLE-3 supervision against the HF engine's on a real model.

Runs on a CUDA GPU in the SGLang target image (`image/sglang.Dockerfile`), or on a CPU in `.venv-sglang`
(`make setup`), where the CUDA-only checks report `"pass": null` and why. Two modes:

    python scripts/smoke_sglang.py --model /models/Llama-3.1-8B-Instruct            # one comparison
    python scripts/smoke_sglang.py --model /models/Llama-3.1-8B-Instruct --suite    # the acceptance suite

Each check prints one JSON line, `{"check": NAME, "pass": true|false|null, ...figures}`; the exit code is 0
only when no check failed. The comparisons and the check runner are shared with scripts/smoke_vllm.py
(`eagle3_target.acceptance`); docs/sglang.md says what each check proves.
"""

from __future__ import annotations

import gc
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from eagle3_target import acceptance
from eagle3_target.acceptance import Reference
from eagle3_target.runners.base import InvalidInput
from eagle3_target.runners.sglang import SGLangRunner, open_runners

app = typer.Typer(add_completion=False)


def scratch_entries() -> set[str]:
    """What is in /dev/shm and the temp directory: where SGLang or its libraries could leave files."""
    dirs = (Path("/dev/shm"), Path(tempfile.gettempdir()))
    return {str(p) for d in dirs if d.is_dir() for p in d.iterdir()}


def allocated_gib() -> float:
    return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def child_processes() -> list[int]:
    """This process's children (Linux: every thread's `children` file)."""
    files = Path(f"/proc/{os.getpid()}/task").glob("*/children")
    return sorted({int(pid) for f in files for pid in f.read_text().split()})


@dataclass(kw_only=True)
class Suite(Reference):
    """The shared reference plus SGLang's options and its one open runner (SGLang builds its process
    groups once a process, so the checks share a runner and reopen it only for other arguments)."""

    engine_args: dict[str, str]
    max_batch_tokens: int
    deployed_fraction: float
    _runner: SGLangRunner | None = field(default=None, repr=False)
    _runner_args: dict[str, Any] = field(default_factory=dict, repr=False)

    def sglang(self, capture_layer_ids: list[int] | None = None, **engine_args: object) -> SGLangRunner:
        """The open runner if it has these engine arguments, else a fresh one with them."""
        args: dict[str, Any] = {**self.engine_args, "max_batch_tokens": str(self.max_batch_tokens)}
        args |= {key: str(value) for key, value in engine_args.items()}
        if self._runner is None or args != self._runner_args:
            self.close_sglang()
            self._runner = SGLangRunner.from_pretrained(
                self.model, dtype=self.dtype, device=self.device, capture_layer_ids=capture_layer_ids, **args
            )
            self._runner_args = args
        elif capture_layer_ids is not None:
            self._runner.set_capture_layers(capture_layer_ids)
        return self._runner

    def close_sglang(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None


# ---- the checks (docs/sglang.md, "Acceptance suite") ------------------------------------------------------


def check_agreement(suite: Suite) -> dict[str, Any]:
    """S1: a ragged batch at the default aux layers agrees with the HF engine."""
    runner = suite.sglang(capture_layer_ids=None)
    return suite.compare(runner, *suite.batch(8, suite.seq_len))


def check_aux_order(suite: Suite) -> dict[str, Any]:
    """S2: aux ids that are not ascending come back in the requested order (SGLang packs them ascending),
    set on the open runner without a reload."""
    layers = suite.num_layers()
    aux = [2 * layers // 3, 1, layers // 3 + 1]
    result = suite.compare(suite.sglang(aux), *suite.batch(4, max(8, suite.seq_len // 4)))
    return result | {"requested": aux, "pass": result["pass"] and result["capture_layer_ids"] == aux}


def check_length_boundary(suite: Suite) -> dict[str, Any]:
    """S3: with max_model_len = N, a row of exactly N tokens is captured at every position and a row of
    N + 1 is refused before SGLang runs."""
    row = max(8, suite.seq_len // 4)
    runner = suite.sglang(max_model_len=row)
    input_ids, mask = suite.batch(1, row + 1)
    try:
        runner.forward_hidden(input_ids)
        refused = None
    except InvalidInput as exc:
        refused = str(exc)
    result = suite.compare(runner, input_ids[:, :row], mask[:, :row])
    return result | {
        "pass": result["pass"] and refused is not None,
        "max_model_len": row,
        "row_tokens": row,
        "longer_row_refused": refused,
    }


def check_throughput(suite: Suite) -> dict[str, Any]:
    """Prefill tokens/s with the capture (aux layers, every position's final hidden state) and without
    it (SGLang's own prefill on the same runner: no aux, last-position logits); the goal, on a GPU, is
    extraction within 10% of plain prefill. On another device the figures are printed, not judged."""
    suite.drop_hf()
    runner = suite.sglang()
    gen = torch.Generator().manual_seed(suite.seed)
    prompts = torch.randint(0, runner.model.config.vocab_size, (16, suite.seq_len), generator=gen)
    _, extracting = acceptance.timed(lambda: runner.forward_hidden(prompts), suite.repeats)
    _, baseline = acceptance.timed(lambda: runner.plain_prefill(prompts), suite.repeats)
    ratio = baseline / extracting
    skipped = suite.not_on_cuda()
    return (skipped or {"pass": ratio >= 0.9}) | {
        "tokens_per_batch": prompts.numel(),
        "extraction_tokens_per_s": round(prompts.numel() / extracting, 1),
        "plain_prefill_tokens_per_s": round(prompts.numel() / baseline, 1),
        "ratio": round(ratio, 3),
    }


def check_memory_headroom(suite: Suite) -> dict[str, Any]:
    """At the deployed mem_fraction_static, the runner's head and the [B,S,V] logits of a full
    --max-batch-tokens batch fit beside SGLang's weights and KV cache on the same GPU."""
    skipped = suite.not_on_cuda()
    if skipped is not None:
        return skipped
    suite.drop_hf()
    runner = suite.sglang(mem_fraction_static=suite.deployed_fraction)
    used = acceptance.batch_memory(runner, suite.max_batch_tokens, suite.seq_len, runner.max_prompt_len)
    return used | {"mem_fraction_static": suite.deployed_fraction}


def check_nothing_left_behind(suite: Suite) -> dict[str, Any]:
    """After the others, closing the runner leaves no SGLang runner open and no process group; and one
    more runner, opened, run and closed, leaves no new child process, no new file in /dev/shm or in the
    temp directory (a fresh one for the cycle) and, on a GPU, no more memory allocated. (What a process
    holds once, whoever opened it first, is not the runner's: tqdm's lock and Python's resource tracker.)"""
    suite.drop_hf()
    suite.close_sglang()
    closed = {
        "open_runners": len(open_runners()),
        "process_group": torch.distributed.is_available() and torch.distributed.is_initialized(),
    }
    previous_tempdir = tempfile.tempdir
    with tempfile.TemporaryDirectory() as cycle_tempdir:
        tempfile.tempdir = cycle_tempdir
        try:
            gc.collect()
            before = (scratch_entries(), child_processes(), allocated_gib())
            runner = suite.sglang()
            runner.forward_hidden(torch.ones(2, 8, dtype=torch.long))
            suite.close_sglang()
            del runner
            gc.collect()
            after = (scratch_entries(), child_processes(), allocated_gib())
        finally:
            tempfile.tempdir = previous_tempdir
    left = closed | {
        "new_child_processes": sorted(set(after[1]) - set(before[1])),
        "new_scratch_files": sorted(after[0] - before[0])[:10],
    }
    growth = round(after[2] - before[2], 3)
    return {"pass": not any(left.values()) and growth < 0.01} | left | {"cuda_allocated_gib_growth": growth}


CHECKS: dict[str, Callable[[Suite], dict[str, Any]]] = {
    "S1-agreement": check_agreement,
    "S2-aux-order": check_aux_order,
    "S3-length-boundary": check_length_boundary,
    "prefill-throughput": check_throughput,
    "memory-headroom": check_memory_headroom,
    "nothing-left-behind": check_nothing_left_behind,
}


@app.command()
def main(
    model: acceptance.ModelOption,
    suite: acceptance.SuiteOption = False,
    checks: acceptance.ChecksOption = "",
    engine_arg: acceptance.EngineArgOption = None,
    fraction: Annotated[
        float | None,
        typer.Option(help="SGLang's mem_fraction_static (default 0.45: HF needs the rest); not on CPU"),
    ] = None,
    dtype: acceptance.DtypeOption = "bfloat16",
    device: acceptance.DeviceOption = None,
    seq_len: acceptance.SeqLenOption = 2048,
    max_batch_tokens: Annotated[int, typer.Option(help="as the server's --max-batch-tokens")] = 16384,
    deployed_fraction: Annotated[float, typer.Option(help="memory-headroom's mem_fraction_static")] = 0.8,
    repeats: acceptance.RepeatsOption = 3,
    seed: acceptance.SeedOption = 0,
    min_argmax: acceptance.MinArgmaxOption = 0.95,
    min_cosine: acceptance.MinCosineOption = 0.99,
    max_mean_logit_diff: Annotated[float, typer.Option(help="largest mean |SGLang - HF| logit")] = 0.1,
) -> None:
    selected = acceptance.select_checks(checks, CHECKS)
    device = acceptance.default_device(device)
    share = fraction or (0.45 if device.startswith("cuda") else None)
    engine_args = (
        {} if share is None else {"mem_fraction_static": str(share)}
    ) | acceptance.parse_engine_args(engine_arg or [])
    context = Suite(
        model=model,
        dtype=dtype,
        device=device,
        seq_len=seq_len,
        repeats=repeats,
        seed=seed,
        min_argmax=min_argmax,
        min_cosine=min_cosine,
        max_mean_logit_diff=max_mean_logit_diff,
        engine_args=engine_args,
        max_batch_tokens=max_batch_tokens,
        deployed_fraction=deployed_fraction,
    )
    try:
        if suite:
            passed = acceptance.run_checks(CHECKS, context, selected)
        else:
            passed = acceptance.run_checks({"comparison": check_agreement}, context, ["comparison"])
    finally:
        context.drop_hf()
        context.close_sglang()
    raise typer.Exit(0 if passed else 1)


if __name__ == "__main__":
    app()
