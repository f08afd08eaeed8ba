"""Every engine of `eagle3_target.engines.ENGINES` captures any capture set the same way, checked against
transformers itself (not against another runner): layer id i is `output_hidden_states[i + 1]`, except id
L-1, the last decoder layer's output before the final norm (transformers hands back its last hidden state
after the norm, so L-1 is read with a forward hook and `hidden_states[L]` is the post-norm final state).

Tiny Llama and Qwen3 checkpoints in fp32 with random norm weights, a right-padded ragged batch, compared at
the real positions within each engine's tolerance: HF runs transformers' own forward (rounding only), vLLM
and SGLang their own kernels (measured under 1e-5; their modules allow 1e-4).

An engine with an image variant of its own has an environment of its own here (`.venv-<variant>`, e.g.
SGLang's, where vLLM is a stub): the module runs the engines of the environment it runs in, and `make test`
runs it in each (Makefile's `<VARIANT>_TESTS`; the last test checks that). Each engine loads each checkpoint
once; vLLM restarts only for the single-layer test (its capture layers are fixed at engine start).
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from eagle3_target.engines import ENGINES
from eagle3_target.runners import TargetRunner, load_runner
from torch import Tensor
from transformers import AutoModelForCausalLM

from support.hidden_states import TransformersStates, transformers_states
from support.supervision import ragged_rows
from support.vllm_runner import CPU_ENGINE_ARGS

NUM_LAYERS = 8  # the tiny checkpoints'
LAST = NUM_LAYERS - 1
# Five layers, not ascending, the last one included; then the same layers in another order.
FIVE = [5, 0, LAST, 3, 2]
FIVE_REORDERED = [2, LAST, 0, 5, 3]
ATOL = {"hf": 1e-5, "vllm": 1e-4, "sglang": 1e-4}
ARCHS = ("llama", "qwen3")

# The image variant whose environment runs this interpreter: "" for .venv, "sglang" for .venv-sglang.
VARIANT = Path(sys.prefix).name.removeprefix(".venv").removeprefix("-")
HERE = [name for name, engine in ENGINES.items() if engine.image_variant == VARIANT]
MAKEFILE = Path(__file__).resolve().parents[3] / "Makefile"


def engine_kwargs(engine: str, scratch: Path) -> dict[str, object]:
    """Small CPU engines: a short context, a batch budget their KV cache holds, no compilation."""
    if engine == "vllm":
        return {
            "hidden_states_dir": str(scratch),
            "max_model_len": 64,
            "max_batch_tokens": 256,
            **CPU_ENGINE_ARGS,
        }
    if engine == "sglang":
        return {"max_model_len": 64, "max_batch_tokens": 256}
    return {}


class Runners:
    """One runner per engine open at a time (SGLang allows one per process), for the checkpoint asked for
    last: asking an engine for another checkpoint closes its open one first."""

    def __init__(self, paths: dict[str, Path], scratch: Path) -> None:
        self.paths = paths
        self.scratch = scratch
        self.open: dict[str, tuple[str, TargetRunner]] = {}

    def get(self, engine: str, arch: str) -> TargetRunner:
        if engine in self.open and self.open[engine][0] != arch:
            self.open.pop(engine)[1].close()
        if engine not in self.open:
            runner = load_runner(
                engine,
                self.paths[arch],
                dtype="float32",
                device="cpu",
                capture_layer_ids=FIVE,
                **engine_kwargs(engine, self.scratch / f"{engine}-{arch}"),
            )
            self.open[engine] = (arch, runner)
        return self.open[engine][1]

    def close(self) -> None:
        for _, runner in self.open.values():
            runner.close()
        self.open.clear()


@pytest.fixture(scope="module")
def runners(
    tiny_llama_dir: Path, tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Runners]:
    opened = Runners({"llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir}, tmp_path_factory.mktemp("scratch"))
    yield opened
    opened.close()


@functools.cache
def expected(path: Path) -> tuple[Tensor, Tensor, TransformersStates]:
    """(input_ids, attention_mask, what transformers computes for them) on the checkpoint at `path`."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.config.num_hidden_layers == NUM_LAYERS
    input_ids, mask = ragged_rows(model.config.vocab_size)
    return input_ids, mask, transformers_states(model, input_ids, mask)


def assert_captures(runner: TargetRunner, engine: str, path: Path, layer_ids: list[int]) -> None:
    """forward_hidden (post-norm and pre-norm) and forward_eagle3 against transformers, at real positions."""
    input_ids, mask, want = expected(path)
    valid = mask.bool()
    tol = {"atol": ATOL[engine], "rtol": ATOL[engine]}
    assert runner.capture_layer_ids == layer_ids
    final, captured = runner.forward_hidden(input_ids, mask)
    prenorm, captured_prenorm = runner.forward_hidden(input_ids, mask, prenorm=True)
    logits, captured_eagle3 = runner.forward_eagle3(input_ids, mask)
    hidden = runner.model.config.hidden_size
    assert captured.shape == (*input_ids.shape, len(layer_ids) * hidden)
    for got in (captured, captured_prenorm, captured_eagle3):
        torch.testing.assert_close(got[valid], want.captured(layer_ids)[valid], **tol)
    torch.testing.assert_close(final[valid], want.postnorm[valid], **tol)
    torch.testing.assert_close(prenorm[valid], want.prenorm[valid], **tol)
    torch.testing.assert_close(logits[valid], want.logits[valid], **tol)


@pytest.mark.parametrize(("arch", "engine"), [(arch, engine) for arch in ARCHS for engine in HERE])
def test_a_capture_set_in_any_order_matches_transformers(
    runners, engine, arch, tiny_llama_dir, tiny_qwen3_dir
):
    path = tiny_llama_dir if arch == "llama" else tiny_qwen3_dir
    runner = runners.get(engine, arch)
    runner.set_capture_layers(FIVE)  # as loaded, unless another test changed it since
    assert_captures(runner, engine, path, FIVE)
    runner.set_capture_layers(FIVE_REORDERED)
    assert_captures(runner, engine, path, FIVE_REORDERED)


@pytest.mark.parametrize("engine", HERE)
def test_the_last_layer_alone_is_the_prenorm_final_state(runners, engine, tiny_qwen3_dir):
    """On the checkpoint the previous test left open: a single layer, the one no engine's own capture takes
    (vLLM's capture id L is the final state it captures anyway; SGLang captures a layer as the next one's
    input)."""
    runner = runners.get(engine, "qwen3")
    runner.set_capture_layers([LAST])
    assert_captures(runner, engine, tiny_qwen3_dir, [LAST])


def test_every_environment_runs_this_module():
    """Every engine runs in some environment: the default one (no image variant) runs every test module,
    and each variant's environment this module, through the Makefile's `<VARIANT>_TESTS`."""
    module = Path(__file__).resolve().relative_to(MAKEFILE.parent).as_posix()
    for variant in {engine.image_variant for engine in ENGINES.values()} - {""}:
        listed = re.search(rf"^{variant.upper()}_TESTS :=(.*)$", MAKEFILE.read_text(), re.MULTILINE)
        assert listed is not None and module in listed.group(1).split(), (
            f"{module} not in {variant.upper()}_TESTS"
        )
    assert HERE, f"no engine runs in this environment ({sys.prefix})"
