"""The method presets against the trainers' own code: speculators 0.9 and NeMo AutoModel 0.7.0 (both installed
in .venv) compute their defaults here, and the presets must be those, converted to our layer ids. A trainer
release that changes a default fails this test."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from eagle3_target.methods import (
    METHODS,
    dflash_layer_ids,
    dspark_layer_ids,
    hf_layer_ids,
    method,
    vllm_capture_ids,
)
from eagle3_target.protocol import FINAL_STATES
from nemo_automodel.components.speculative.dflash.draft_qwen3 import build_target_layer_ids as nemo_dflash
from nemo_automodel.components.speculative.dspark.registry import build_target_layer_ids as nemo_dspark
from nemo_automodel.components.speculative.eagle.target import default_eagle3_aux_layer_ids as nemo_eagle3
from speculators.models.mtp.core import MTPDraftModel
from speculators.models.utils import resolve_target_layer_ids

DEPTHS = [8, 12, 16, 28, 32, 36, 40, 61, 80, 94]


def speculators_default(tmp_path: Path, num_hidden_layers: int) -> list[int]:
    """speculators' `resolve_target_layer_ids` with no ids given (EAGLE-3, P-EAGLE, and its DFlash/DSpark
    fallback), for a verifier config of this depth."""
    verifier = tmp_path / f"verifier-{num_hidden_layers}"
    verifier.mkdir()
    (verifier / "config.json").write_text(
        json.dumps({"model_type": "llama", "num_hidden_layers": num_hidden_layers})
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it warns that the ids were not given explicitly
        return resolve_target_layer_ids(None, str(verifier))


@pytest.mark.parametrize("depth", DEPTHS)
def test_eagle3_and_peagle_defaults_are_speculators_and_nemos(depth, tmp_path):
    vllm_ids = speculators_default(tmp_path, depth)
    for name in ("eagle3", "peagle"):
        preset = method(name)
        assert preset.default_layer_ids(depth) == hf_layer_ids(vllm_ids, depth) == nemo_eagle3(depth)
        assert vllm_capture_ids(preset.default_layer_ids(depth)) == vllm_ids
        assert preset.final == "prenorm"  # speculators' appended id N: h_L before the final norm
        assert preset.layers == len(vllm_ids)


@pytest.mark.parametrize("depth", DEPTHS)
def test_mtp_reads_only_the_prenorm_last_state(depth):
    # MTPDraftModel.target_layer_ids reads nothing but the verifier's depth from its config.
    model = SimpleNamespace(
        config=SimpleNamespace(transformer_layer_config=SimpleNamespace(num_hidden_layers=depth))
    )
    vllm_ids = MTPDraftModel.target_layer_ids.fget(model)  # type: ignore[attr-defined]  # a property
    # vLLM id N is the pre-norm last state, our L-1: served as final="prenorm", not as a layer.
    assert hf_layer_ids(vllm_ids, depth) == [depth - 1]
    assert method("mtp").default_layer_ids(depth) == []
    assert method("mtp").final == "prenorm" and method("mtp").layers == 0


@pytest.mark.parametrize("depth", DEPTHS)
def test_dflash_default_is_nemos_spread(depth):
    preset = method("dflash")
    assert preset.default_layer_ids(depth) == nemo_dflash(depth, preset.layers)
    assert max(preset.default_layer_ids(depth)) < depth - 1  # all intermediate: the same in both conventions
    # speculators' DFlash reads verifier_last_hidden_states (pre-norm, normed by the draft's verifier_norm).
    assert preset.final == "prenorm"


@pytest.mark.parametrize("depth", DEPTHS)
def test_dspark_default_is_nemos_spread_with_its_last_id_as_the_postnorm_state(depth):
    preset = method("dspark")
    nemo = nemo_dspark(depth, preset.layers)
    # NeMo reads id L-1 after the final norm: that feature is DSpark's post-norm final state here.
    assert preset.default_layer_ids(depth) == [i for i in nemo if i != depth - 1]
    assert depth - 1 in nemo
    assert preset.final == "postnorm"


@pytest.mark.parametrize("count", [1, 2, 3, 6])
def test_the_spreads_follow_nemo_for_other_layer_counts(count):
    """Both round half to even, like NeMo's `int(round(...))` (94 layers: 1 + 90/4 = 23.5 -> 24)."""
    for depth in DEPTHS:
        assert dflash_layer_ids(depth, count) == nemo_dflash(depth, count)
        assert dspark_layer_ids(depth, count) == [i for i in nemo_dspark(depth, count) if i != depth - 1]


def test_every_preset_names_a_served_final_state():
    assert {m.final for m in METHODS.values()} <= set(FINAL_STATES)
    assert set(METHODS) >= {"eagle3", "peagle", "dflash", "dspark", "mtp"}


def test_method_refusals():
    assert method("dflash").default_layer_ids(36) == [1, 9, 17, 25, 33]
    with pytest.raises(ValueError, match="unknown draft method 'eagle9'"):
        method("eagle9")
    with pytest.raises(ValueError, match="do not fit a target with 4 layers"):
        method("eagle3").default_layer_ids(4)
    with pytest.raises(ValueError, match=r"vLLM capture ids \[0\] cannot be served"):
        hf_layer_ids([0, 3], 8)
