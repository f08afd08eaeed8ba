"""The SGLang runner against real SGLang 0.5.23 on this CPU (`make setup` installs it in .venv-sglang, and
`make test` runs this module with that environment's python), on tiny Llama and Qwen3 checkpoints with
random norm weights.

The reference is the HF runner on the same checkpoint, in fp32: SGLang's own layers (its RMSNorm, its
torch-native attention) differ from transformers' in rounding only, so every format is compared within
1e-4 (measured: under 5e-6). SGLang builds its process groups once a process, so one engine is open at a
time: the Llama one serves the module's tests in order, then the Qwen3 one replaces it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sgl_kernel
import torch
from eagle3_target.runners import InvalidInput, ModelRefused, check_engine_args
from eagle3_target.runners.hf import HFRunner
from eagle3_target.runners.sglang import SGLangRunner

from support.sglang_runner import OneEngine
from support.supervision import (
    assert_every_format_matches,
    ragged_rows,
)
from support.vllm_runner import copy_model

ATOL = 1e-4
AUX = [5, 0, 3]
MAX_MODEL_LEN = 200
MAX_BATCH_TOKENS = 2048


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path, tiny_qwen3_dir: Path) -> Iterator[OneEngine]:
    opened = OneEngine(
        {"llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir},
        capture_layer_ids=AUX,
        max_batch_tokens=MAX_BATCH_TOKENS,
        max_model_len=MAX_MODEL_LEN,
        max_running_requests="7",
    )
    yield opened
    opened.close()


def test_the_engine_arguments_reach_sglang(engines):
    runner = engines["llama"]
    args = runner.engine.server_args
    assert args.max_running_requests == 7 and args.context_length == MAX_MODEL_LEN
    # The runner sets the capture list on the model itself (SGLang's layer indices: HF id + 1), not through
    # --return-aux-hidden-state-layer-ids, whose first-forward count check a capture set may outgrow.
    assert args.enable_return_aux_hidden_states and args.return_aux_hidden_state_layer_ids is None
    assert runner.placements()[0][3] == [1, 4, 6]
    assert args.disable_radix_cache and args.skip_tokenizer_init and args.device == "cpu"
    # The CPU KV cache holds a whole batch; the longest row is captured at every position, one more refused.
    assert runner.engine.max_total_num_tokens >= MAX_BATCH_TOKENS
    longest = torch.randint(0, 256, (1, MAX_MODEL_LEN))
    final, aux = runner.forward_hidden(longest)
    assert final.shape == (1, MAX_MODEL_LEN, 64) and bool(aux[0, -1].abs().sum() > 0)
    with pytest.raises(ValueError, match=f"at most {MAX_MODEL_LEN}"):
        runner.forward_hidden(torch.randint(0, 256, (1, MAX_MODEL_LEN + 1)))


def test_a_batch_beyond_sglangs_request_pool_is_refused_before_compute_and_the_engine_serves_on(engines):
    """SGLang allocates its request pool (max_running_requests rows) and KV cache once; a batch beyond either
    would fail inside its allocation, not even with SGLang's own message (the runner has no prefix cache to
    evict from). The KV cache's refusal: test_sglang_tp_on_sglang_cpu.py."""
    runner = engines["llama"]
    rows = runner.engine.req_to_token_pool.available_size()
    with pytest.raises(
        InvalidInput, match=f"the batch has {rows + 1} rows; the engine's request pool holds {rows}"
    ):
        runner.forward_hidden(torch.randint(0, 256, (rows + 1, 1)))
    assert runner.failure is None
    final, _ = runner.forward_hidden(torch.randint(0, 256, (rows, 3)))
    assert final.shape == (rows, 3, 64)


def test_a_second_engine_in_the_process_is_refused(engines, tiny_qwen3_dir):
    engines["llama"]
    with pytest.raises(ModelRefused, match="already open in this process"):
        SGLangRunner.from_pretrained(tiny_qwen3_dir, dtype="float32", device="cpu")


def test_set_capture_layers_changes_the_capture_without_a_reload(engines, tiny_llama_dir):
    runner = engines["llama"]
    before = runner.engine
    input_ids, mask = ragged_rows(256)
    valid = mask.bool()
    try:
        runner.set_capture_layers([4, 1, 3])
        assert runner.engine is before and runner.capture_layer_ids == [4, 1, 3]
        hf = HFRunner.from_pretrained(
            tiny_llama_dir, dtype="float32", device="cpu", capture_layer_ids=[4, 1, 3]
        )
        logits, aux = runner.forward_eagle3(input_ids, mask)
        hf_logits, hf_aux = hf.forward_eagle3(input_ids, mask)
        torch.testing.assert_close(aux[valid], hf_aux[valid], atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(logits[valid], hf_logits[valid], atol=ATOL, rtol=ATOL)
    finally:
        runner.set_capture_layers(AUX)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_every_format_matches_the_hf_engine(engines, arch, tiny_llama_dir, tiny_qwen3_dir):
    runner = engines[arch]
    path = tiny_llama_dir if arch == "llama" else tiny_qwen3_dir
    hf = HFRunner.from_pretrained(path, dtype="float32", device="cpu", capture_layer_ids=AUX)
    assert runner.capture_layer_ids == AUX and runner.model.norm.dtype == torch.float32
    input_ids, mask = ragged_rows(runner.model.config.vocab_size)
    valid = mask.bool()
    assert_every_format_matches(runner, hf, input_ids, mask, ATOL)
    # Padding is zeros, and the pre-norm state is not the final one (random norm weights).
    prenorm, aux = runner.forward_hidden(input_ids, mask, prenorm=True)
    final, _ = runner.forward_hidden(input_ids, mask)
    assert not prenorm[~valid].any() and not final[~valid].any() and not aux[~valid].any()
    assert not torch.allclose(prenorm[valid], final[valid], atol=1e-2)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"mem_fraction_statc": "0.5"},
            r"unknown engine argument mem_fraction_statc \(did you mean mem_fraction_static\?\)",
        ),
        ({"model-path": "/x"}, "set by the SGLang runner: pass the model directory"),
        ({"return_aux_hidden_state_layer_ids": "1 2 3"}, "set by the SGLang runner"),
        ({"pp_size": "2"}, "pp_size=2 is not supported by the SGLang runner: SGLang's aux capture"),
        ({"dp_size": "2"}, "dp_size=2 is not supported"),
        ({"enable_torch_compile": "maybe"}, "expected a boolean"),
        (
            {"mem_fraction_static": "lots"},
            "SGLang refuses the engine arguments: argument --mem-fraction-static",
        ),
    ],
)
def test_engine_arguments_are_refused_before_loading(args, message):
    with pytest.raises(ModelRefused, match=message):
        check_engine_args("sglang", args)


def test_sglangs_own_arguments_pass_the_check():
    check_engine_args(
        "sglang",
        {"mem_fraction_static": "0.8", "enable_torch_compile": "false", "max_running_requests": 4},
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"logit_scale": 2.0}, "config.logit_scale transforms the logits"),
        ({"architectures": ["NoSuchForCausalLM"]}, "SGLang 0.5.23 has no model class"),
        ({"architectures": ["GPT2LMHeadModel"]}, "cannot capture EAGLE-3 aux hidden states"),
    ],
)
def test_models_it_cannot_capture_exactly_are_refused_before_loading(
    tiny_llama_dir, tmp_path, changes, message
):
    model = copy_model(tiny_llama_dir, tmp_path / "model", **changes)
    with pytest.raises(ModelRefused, match=message):
        SGLangRunner.from_pretrained(model, dtype="float32", device="cpu")


@pytest.mark.parametrize(
    ("budget", "why"), [("many", "invalid literal for int"), ("0", "expected a positive")]
)
def test_a_batch_budget_that_is_no_positive_integer_is_refused_before_loading(tiny_llama_dir, budget, why):
    with pytest.raises(ModelRefused, match=rf"max_batch_tokens='{budget}': {why}"):
        SGLangRunner.from_pretrained(tiny_llama_dir, dtype="float32", device="cpu", max_batch_tokens=budget)


def test_the_sgl_kernel_stand_in_refuses_every_call_and_lives_only_here():
    assert sgl_kernel.STAND_IN and len(sgl_kernel.NAMES) == 8
    for name in sgl_kernel.NAMES:
        with pytest.raises(sgl_kernel.StandInCalled, match=f"sgl_kernel.{name} was called"):
            getattr(sgl_kernel, name)(1, key=2)
    assert Path(sgl_kernel.__file__).is_relative_to(sys.prefix)
    assert not any(
        (Path(p) / "sgl_kernel").exists() for p in sys.path if not Path(p).is_relative_to(sys.prefix)
    )
