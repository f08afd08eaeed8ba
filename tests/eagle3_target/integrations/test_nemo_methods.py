"""NeMo AutoModel 0.7.0's own DFlash and DSpark target wrappers, run in-process on the tiny bf16 Llama, give
exactly the tensors a served target's `format=layers` answer carries for the same batch (HF engine, a real
server over loopback, read with `TargetClient.hidden_states`).

The references are NeMo's real classes, `components.speculative.dflash.target.HFDFlashTargetModel` and
`components.speculative.dspark.target.HFDSparkTargetModel` (installed --no-deps, like the other trainers).
What they feed the draft, unshifted, in the model dtype:
- DFlash: the outputs of decoder layers `target_layer_ids` (forward hooks; id L-1 is the last layer's own
  output, before the final norm), concatenated in that order; no final state;
- DSpark: the same, except that id L-1 is the final norm's output (after the norm), plus that post-norm
  state again on its own. A DSpark trainer therefore asks for its ids below L-1 and `final=postnorm`, and
  puts the final state in id L-1's slot (`dspark_features`); asking for layer L-1 instead would hand it the
  pre-norm state, which the test shows differs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from eagle3_target.client import TargetClient
from nemo_automodel.components.speculative.dflash import draft_qwen3 as dflash_draft
from nemo_automodel.components.speculative.dflash.target import HFDFlashTargetModel
from nemo_automodel.components.speculative.dspark import registry as dspark_registry
from nemo_automodel.components.speculative.dspark.target import HFDSparkTargetModel
from torch import Tensor

from support.server_process import ServerProcess, start_server
from support.supervision import token_batch
from support.trainer_rows import MAX_BATCH_TOKENS, MAX_MODEL_LEN

NUM_LAYERS = 8  # the bf16 tiny Llama's depth (integrations/conftest.py)
LAST = NUM_LAYERS - 1
DRAFT_LAYERS = 5  # NeMo's default draft depth, which picks its default target layers
# Every layer, in no sorted order, so that the answer's layer order is the one asked for, not the capture's.
CAPTURE_LAYER_IDS = [5, 7, 0, 3, 1, 6, 2, 4]


@pytest.fixture(scope="module")
def layers_server(bf16_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(
        tmp_path_factory.mktemp("nemo-methods-server"),
        [
            "--model", str(bf16_model_dir),
            "--engine", "hf",
            "--dtype", "bfloat16",
            "--max-model-len", str(MAX_MODEL_LEN),
            "--max-batch-tokens", str(MAX_BATCH_TOKENS),
            "--capture-layer-ids", ",".join(map(str, CAPTURE_LAYER_IDS)),
        ],
    )  # fmt: skip
    yield server
    server.stop()


def batch(seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """Three rows, the last right-padded by 5, as a trainer's collator pads them."""
    return tuple(token_batch(seed, 3, 24, pad_last=5))  # type: ignore[return-value]


def assert_same(got: Tensor, want: Tensor, mask: Tensor) -> None:
    """Bit-equal at every real token (padding positions are no one's supervision)."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=0, rtol=0)


def dspark_features(answer: dict[str, Tensor], ids: Sequence[int], hidden: int) -> Tensor:
    """DSpark's context features from a `layers` answer asked with `layers=[i for i in ids if i < L-1]` and
    `final=postnorm`: each id's slice, id L-1's being the post-norm final state."""
    layers = answer["hidden_states"].split(hidden, dim=-1) if "hidden_states" in answer else ()
    below = iter(layers)
    return torch.cat([answer["final_hidden"] if i == LAST else next(below) for i in ids], dim=-1)


def test_nemo_defaults_for_the_tiny_model():
    """The ids the cases below call "NeMo's defaults" (DFlash spreads over [1, L-3]; DSpark over [1, L-1],
    ending at the post-norm last layer)."""
    assert dflash_draft.build_target_layer_ids(NUM_LAYERS, DRAFT_LAYERS) == [1, 2, 3, 4, 5]
    assert dspark_registry.build_target_layer_ids(NUM_LAYERS, DRAFT_LAYERS) == [1, 2, 4, 6, LAST]


@pytest.mark.parametrize(
    "ids",
    [
        pytest.param(dflash_draft.build_target_layer_ids(NUM_LAYERS, DRAFT_LAYERS), id="nemo-default"),
        pytest.param([6, 0, 3, LAST, 2], id="last-layer-unsorted"),
    ],
)
def test_dflash_context_is_nemos(layers_server, plain_model, ids):
    input_ids, mask, loss_mask = batch(31)
    with TargetClient(layers_server.url) as client:
        answer = client.hidden_states(input_ids, mask, layers=ids)
    want = HFDFlashTargetModel(plain_model, ids).generate_batch(input_ids, mask, loss_mask)
    assert sorted(answer) == ["hidden_states"]
    assert_same(answer["hidden_states"], want.hidden_states, mask)


@pytest.mark.parametrize(
    "ids",
    [
        pytest.param(dspark_registry.build_target_layer_ids(NUM_LAYERS, DRAFT_LAYERS), id="nemo-default"),
        pytest.param([0, 3, 5], id="below-the-last-layer"),
        pytest.param([LAST], id="last-layer-alone"),
    ],
)
def test_dspark_features_are_nemos(layers_server, plain_model, ids):
    input_ids, mask, loss_mask = batch(32)
    below_last = [i for i in ids if i != LAST]
    with TargetClient(layers_server.url) as client:
        answer = client.hidden_states(input_ids, mask, layers=below_last, final="postnorm")
        pre_norm_last = client.hidden_states(input_ids, mask, layers=[LAST])["hidden_states"]
    want = HFDSparkTargetModel(plain_model, ids).generate_batch(input_ids, mask, loss_mask)
    hidden = plain_model.config.hidden_size
    assert_same(dspark_features(answer, ids, hidden), want.target_hidden_states, mask)
    assert_same(answer["final_hidden"], want.target_last_hidden_states, mask)
    # Layer L-1 as served is the pre-norm state DFlash takes, not DSpark's post-norm feature.
    valid = mask.bool()
    assert not torch.equal(pre_norm_last[valid], want.target_last_hidden_states[valid])
