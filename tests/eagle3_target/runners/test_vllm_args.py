"""vLLM engine arguments: typed from CLI strings, unknown and runner-owned keys refused, every key one that
vLLM 0.33 takes."""

from __future__ import annotations

import pytest
from eagle3_target.runners import ModelRefused
from eagle3_target.runners.vllm_args import ENGINE_ARG_PARSERS, RUNNER_OWNED_ARGS, vllm_engine_kwargs


def test_engine_kwargs_are_typed():
    assert vllm_engine_kwargs(
        {
            "gpu-memory-utilization": "0.85",
            "max_model_len": "4096",
            "tensor_parallel_size": 2,
            "quantization": "fp8",
            "enforce_eager": "off",
            "compilation_config": '{"mode": 0}',
            "hf_overrides": {"rope_theta": 10000},
            "seed": "-1",
        }
    ) == {
        "gpu_memory_utilization": 0.85,
        "max_model_len": 4096,
        "tensor_parallel_size": 2,
        "quantization": "fp8",
        "enforce_eager": False,
        "compilation_config": {"mode": 0},
        "hf_overrides": {"rope_theta": 10000},
        "seed": -1,
    }


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"max_model_lenn": "4096"},
            r"unknown engine argument max_model_lenn \(did you mean max_model_len\?\)",
        ),
        ({"enable_prefix_caching": "true"}, r"set by the vLLM runner: prefix caching is kept off"),
        ({"speculative_config": "{}"}, r"set by the vLLM runner"),
        ({"gpu_memory_utilization": "1.5"}, r"gpu_memory_utilization='1.5': expected a fraction"),
        ({"max_model_len": "4k"}, r"max_model_len='4k'"),
        ({"max_model_len": "0"}, r"expected a positive integer"),
        ({"tensor_parallel_size": True}, r"got a boolean"),
        ({"enforce_eager": "maybe"}, r"expected a boolean"),
        ({"compilation_config": "[1]"}, r"expected a JSON object"),
        ({"max-model-len": "1", "max_model_len": "2"}, r"given twice"),
        # vLLM 0.33's hidden-states connector cannot run on a pipeline stage before the last.
        ({"pipeline_parallel_size": "2"}, r"pipeline_parallel_size=2 .*last pipeline stage"),
        # This backend runs the engine in-process, which never writes the last batch's files.
        ({"distributed_executor_backend": "external_launcher"}, r"VLLM_ENABLE_V1_MULTIPROCESSING=0"),
    ],
)
def test_bad_engine_kwargs_are_refused(args, message):
    with pytest.raises(ModelRefused, match=message):
        vllm_engine_kwargs(args)


def test_single_stage_and_other_executors_are_accepted():
    assert vllm_engine_kwargs({"pipeline_parallel_size": "1", "distributed_executor_backend": "mp"}) == {
        "pipeline_parallel_size": 1,
        "distributed_executor_backend": "mp",
    }


def test_every_engine_arg_has_a_parser_for_its_cli_string():
    samples = {"parse_fraction": "0.5", "parse_positive_int": "1", "int": "3", "float": "1.5", "str": "x"}
    samples |= {"parse_bool": "true", "parse_json_object": "{}"}
    for key, parser in ENGINE_ARG_PARSERS.items():
        assert vllm_engine_kwargs({key: samples[parser.__name__]})[key] == parser(samples[parser.__name__])


def test_every_engine_argument_the_runner_passes_exists_in_vllm_0_33(fake_vllm):
    assert set(ENGINE_ARG_PARSERS) <= fake_vllm.ENGINE_ARGS
    assert set(RUNNER_OWNED_ARGS) <= fake_vllm.ENGINE_ARGS
    assert {"skip_tokenizer_init", "max_logprobs"} <= fake_vllm.ENGINE_ARGS
