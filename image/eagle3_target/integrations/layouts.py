"""The feature files other trainers read, built from one row's unshifted supervision: one home for each
trainer's file layout, tensor names, dtypes and layer-id convention.

- speculators 0.9 (`hs_connectors.FileTransfer`, `speculators.train.data.ArrowDataset`):
  `hidden_states/hs_{i}.safetensors` with `hidden_states` [S, 4, H] (the three aux layers in ascending
  capture order, then h_L *before* the final norm, which speculators applies itself) and `token_ids` [S]
  int64, in the model dtype: what vLLM's hidden-states connector writes. Its layer ids are vLLM capture ids,
  ours + 1.
- SpecForge 0.2 (`specforge_hidden_states_v1`, read by its `OfflineManifestReader`):
  `rows_{g}-{g+2000}/data_{i}.ckpt`, a `torch.save` of `input_ids` [S] int64, `loss_mask` [S] int64,
  `hidden_state` [1, S, H] (after the final norm) and `aux_hidden_state` [1, S, 3H], both bf16 (its
  `TargetHead` is bf16). Its aux layer ids are ours.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import BinaryIO, Protocol

import torch
from safetensors.torch import save
from torch import Tensor

from eagle3_target.contract import NUM_AUX_LAYERS
from eagle3_target.integrations.rows import Row
from eagle3_target.protocol import TargetInfo


class LayoutMismatch(ValueError):
    """The served target cannot produce files this trainer would read correctly."""


class Layout(Protocol):
    """How one trainer's feature files are named and built."""

    name: str
    format: str  # the /v1/supervision format the files are built from

    def check(self, info: TargetInfo) -> None:
        """Raise LayoutMismatch unless the target (its /v1/info) suits this trainer."""
        ...

    def relative_path(self, index: int) -> Path:
        """Where row `index`'s file goes, under the output directory."""
        ...

    def write(self, row: Row, supervision: Mapping[str, Tensor], info: TargetInfo, file: BinaryIO) -> None:
        """Write row's file from its supervision (trimmed to the row: [S, ...], unshifted)."""
        ...


# --- speculators ------------------------------------------------------------------------------------


def speculators_layer_ids(aux_layer_ids: Sequence[int]) -> list[int]:
    """speculators' `--target-layer-ids` for our aux ids: vLLM capture id k is the residual entering layer
    k, the output of our layer k - 1; vLLM keeps them ascending."""
    return sorted(a + 1 for a in aux_layer_ids)


def speculators_sample(
    aux_hidden_states: Tensor, final_hidden_prenorm: Tensor, token_ids: Tensor, aux_layer_ids: Sequence[int]
) -> dict[str, Tensor]:
    """One row as vLLM's file holds it: `hidden_states` [S, 4, H], `token_ids` [S] int64."""
    seq, hidden = final_hidden_prenorm.shape
    layers = aux_hidden_states.reshape(seq, NUM_AUX_LAYERS, hidden)
    ascending = sorted(range(NUM_AUX_LAYERS), key=lambda i: aux_layer_ids[i])
    states = torch.cat((layers[:, ascending], final_hidden_prenorm.unsqueeze(1)), dim=1)
    return {"hidden_states": states.contiguous(), "token_ids": token_ids.to(torch.int64).contiguous()}


class SpeculatorsLayout:
    name = "speculators"
    format = "hidden_prenorm"

    def check(self, info: TargetInfo) -> None:
        if len(info.aux_layer_ids) != NUM_AUX_LAYERS:
            raise LayoutMismatch(f"speculators needs 3 aux layers, the target has {info.aux_layer_ids}")

    def relative_path(self, index: int) -> Path:
        return Path("hidden_states") / f"hs_{index}.safetensors"

    def write(self, row: Row, supervision: Mapping[str, Tensor], info: TargetInfo, file: BinaryIO) -> None:
        sample = speculators_sample(
            supervision["aux_hidden_states"],
            supervision["final_hidden_prenorm"],
            row.input_ids,
            info.aux_layer_ids,
        )
        file.write(save(sample))


# --- SpecForge --------------------------------------------------------------------------------------

SPECFORGE_GROUP_ROWS = 2000
SPECFORGE_DTYPE = "bfloat16"


def specforge_aux_layer_ids(
    num_hidden_layers: int,
    aux_layer_ids: Sequence[int] | None = None,
    draft_config: Path | None = None,
) -> list[int]:
    """The aux layers SpecForge will assume, by its own rule: the run's `model.aux_hidden_state_layer_ids`,
    else the draft config's `eagle_config.eagle_aux_hidden_state_layer_ids`, else `[1, L//2-1, L-4]`."""
    if aux_layer_ids is not None:
        return list(aux_layer_ids)
    if draft_config is not None:
        config = json.loads(draft_config.read_text())
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids is not None:
            return list(ids)
    return [1, num_hidden_layers // 2 - 1, num_hidden_layers - 4]


class SpecForgeLayout:
    name = "specforge"
    format = "hidden"

    def __init__(self, aux_layer_ids: Sequence[int] | None = None, draft_config: Path | None = None) -> None:
        self._aux_layer_ids = aux_layer_ids
        self._draft_config = draft_config

    def check(self, info: TargetInfo) -> None:
        if info.dtype != SPECFORGE_DTYPE:
            raise LayoutMismatch(
                f"SpecForge trains on bf16 features (its TargetHead is bf16) but the target runs in "
                f"{info.dtype}: serve it with --dtype bfloat16"
            )
        expected = specforge_aux_layer_ids(info.num_hidden_layers, self._aux_layer_ids, self._draft_config)
        if info.aux_layer_ids != expected:
            raise LayoutMismatch(
                f"SpecForge will read these features as aux layers {expected}, but the target captures "
                f"{info.aux_layer_ids}: set the target's auxLayerIds to {expected}, or tell "
                "SpecForge (model.aux_hidden_state_layer_ids) and this exporter (--aux-layer-ids) the "
                "target's ids"
            )

    def relative_path(self, index: int) -> Path:
        group = index // SPECFORGE_GROUP_ROWS * SPECFORGE_GROUP_ROWS
        return Path(f"rows_{group}-{group + SPECFORGE_GROUP_ROWS}") / f"data_{index}.ckpt"

    def write(self, row: Row, supervision: Mapping[str, Tensor], info: TargetInfo, file: BinaryIO) -> None:
        # clone(): torch.save writes a view's whole storage, here the whole request's batch.
        record = {
            "input_ids": row.input_ids.clone(),
            "loss_mask": row.loss_mask.clone(),
            "hidden_state": supervision["final_hidden"].to(torch.bfloat16).clone().unsqueeze(0),
            "aux_hidden_state": supervision["aux_hidden_states"].to(torch.bfloat16).clone().unsqueeze(0),
        }
        torch.save(record, file)


LAYOUTS = ("speculators", "specforge")
