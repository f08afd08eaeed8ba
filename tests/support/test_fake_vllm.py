"""The vLLM stand-in (support/fake_vllm) is as strict as vLLM 0.33 where the runner can observe it: it
fails where vLLM fails, and writes the capture layers in each backend's order."""

from __future__ import annotations

from pathlib import Path

import pytest

from support import fake_vllm as stand_in
from support.vllm_runner import copy_model


def stand_in_engine(model_dir: Path, shm: Path, capture_ids: list[int], **kwargs) -> object:
    return stand_in.LLM(
        str(model_dir),
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": capture_ids}},
        },
        kv_transfer_config={
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(shm)},
        },
        **kwargs,
    )


@pytest.mark.parametrize(
    ("capture_ids", "kwargs", "error", "message"),
    [
        ([2, 4, 8], {"max_num_seq": 4}, TypeError, r"unexpected keyword argument 'max_num_seq'"),
        ([2, 2, 8], {}, RuntimeError, r"Expected 3 auxiliary hidden states, got 2"),
        (
            [2, 4, 8],
            {"model_impl": "transformers"},
            ValueError,
            r"'ExtractHiddenStatesModel' is not a registered model in the Transformers library",
        ),
        ([], {}, RuntimeError, r"initialization failed.*eagle_aux_hidden_state_layer_ids must be set"),
        (
            [2, 4, 8],
            {"pipeline_parallel_size": 2},
            RuntimeError,
            r"Expected 1 CacheOnlyAttentionLayer, got 0",
        ),
    ],
)
def test_the_stand_in_fails_where_vllm_does(
    tiny_llama_dir, fake_vllm, shm, capture_ids, kwargs, error, message
):
    with pytest.raises(error, match=message):
        stand_in_engine(tiny_llama_dir, shm, capture_ids, **kwargs)


def test_the_stand_in_writes_in_given_order_on_the_transformers_backend(
    tiny_llama_dir, fake_vllm, shm, tmp_path
):
    """Architectures vLLM does not register run on its Transformers backend, which keeps the order given
    (vLLM's source; not run against real vLLM: its CPU build registers every architecture tried here)."""
    unregistered = copy_model(tiny_llama_dir, tmp_path / "unregistered", architectures=["TinyForCausalLM"])
    native = stand_in_engine(tiny_llama_dir, shm, [7, 2, 8])
    transformers_backend = stand_in_engine(unregistered, shm, [7, 2, 8])
    assert native.capture_layers == (2, 7, 8) and transformers_backend.capture_layers == (7, 2, 8)
    params = fake_vllm.SamplingParams(max_tokens=1, temperature=0.0, logprobs=21)
    with pytest.raises(ValueError, match=r"greater than max allowed: 20"):
        native.generate([{"prompt_token_ids": [1, 2, 3]}], params)
