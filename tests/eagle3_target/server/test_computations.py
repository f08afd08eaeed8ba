"""The engine-side computations (`server/computations.py`) on a real tiny model, without a server process."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from eagle3_target.contract import build_batch
from eagle3_target.runners import TargetRunner
from eagle3_target.runners.base import ForwardHiddenUnsupported
from eagle3_target.server.computations import NEMO_SUPERVISION_KEYS, nemo_generate_compute
from eagle3_target.server.settings import ServerSettings
from eagle3_target.server.target import LoadedTarget, load_target

from support.supervision import draft_mapping, token_batch


class WithoutFullLogits:
    """The real runner, except that asking it for full [B,S,V] logits fails the test."""

    def __init__(self, runner: TargetRunner) -> None:
        self._runner = runner

    def __getattr__(self, name: str) -> object:
        return getattr(self._runner, name)

    def forward_eagle3(self, *_args: object) -> None:
        raise AssertionError("the full [B,S,V] logits were materialised")


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path) -> LoadedTarget:
    return load_target(ServerSettings(model=str(tiny_llama_dir), engine="hf", dtype="float32"))


def nemo_inputs(seed: int) -> dict[str, torch.Tensor]:
    ids, mask, _ = token_batch(seed, 3, 24, pad_last=7)
    loss_mask = mask.clone()
    loss_mask[:, :4] = 0
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}


def nemo_reference(runner: TargetRunner, inputs: dict[str, torch.Tensor], mapping) -> dict[str, torch.Tensor]:
    """NeMo's co-located batch: full logits, then ``build_batch``."""
    logits, aux = runner.forward_eagle3(inputs["input_ids"], inputs["attention_mask"])
    batch = build_batch(
        logits, aux, inputs["input_ids"], inputs["attention_mask"], inputs["loss_mask"], mapping
    )
    return {name: getattr(batch, name) for name in NEMO_SUPERVISION_KEYS}


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(NEMO_SUPERVISION_KEYS)
    for name in NEMO_SUPERVISION_KEYS:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name


def test_nemo_generate_never_builds_full_logits_and_matches_nemo_bit_for_bit(loaded):
    mapping = draft_mapping(48, seed=3)
    inputs = nemo_inputs(seed=4)
    chunked = dataclasses.replace(loaded, runner=WithoutFullLogits(loaded.runner))
    with torch.inference_mode():
        got = nemo_generate_compute(chunked, mapping)(inputs)
        want = nemo_reference(loaded.runner, inputs, mapping)
    assert_bitwise_equal(got, want)


def test_nemo_generate_falls_back_to_full_logits_when_forward_hidden_refuses(tiny_llama_dir, loaded):
    """A softcap makes ``forward_hidden`` refuse; the answer is then NeMo's full-logits batch."""
    softcapped = load_target(ServerSettings(model=str(tiny_llama_dir), engine="hf", dtype="float32"))
    softcapped.runner.model.config.final_logit_softcapping = 30.0
    mapping = draft_mapping(40, seed=5)
    inputs = nemo_inputs(seed=6)
    with torch.inference_mode():
        with pytest.raises(ForwardHiddenUnsupported, match="final_logit_softcapping"):
            softcapped.runner.forward_hidden(inputs["input_ids"], inputs["attention_mask"])
        got = nemo_generate_compute(softcapped, mapping)(inputs)
        want = nemo_reference(loaded.runner, inputs, mapping)
    assert_bitwise_equal(got, want)
