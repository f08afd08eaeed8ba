"""The feature files other trainers read, built from one row's unshifted supervision: one home for each
trainer's file layout, tensor names, dtypes and layer-id convention.

- speculators 0.9 (`hs_connectors.FileTransfer`, `speculators.train.data.ArrowDataset`):
  `hidden_states/hs_{i}.safetensors` with `hidden_states` [S, k+1, H] (the draft's k layers in ascending
  capture order, then h_L *before* the final norm, which speculators applies itself) and `token_ids` [S]
  int64, in the model dtype: what vLLM's hidden-states connector writes, for any draft method (EAGLE-3 and
  P-EAGLE: 3 layers; DFlash, DSpark: their `--target-layer-ids`; MTP: none, only h_L). Its layer ids are
  vLLM capture ids, ours + 1 (see `methods`).
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

from eagle3_target import methods
from eagle3_target.client.target_client import TargetClient
from eagle3_target.contract import select_layers
from eagle3_target.integrations.rows import Row
from eagle3_target.methods import vllm_capture_ids
from eagle3_target.protocol import LAYERS_TENSOR, TargetInfo


class LayoutMismatch(ValueError):
    """The served target cannot produce files this trainer would read correctly."""


class Layout(Protocol):
    """How one trainer's feature files are named and built."""

    name: str

    def check(self, info: TargetInfo) -> None:
        """Raise LayoutMismatch unless the target (its /v1/info) suits this trainer."""
        ...

    @property
    def format(self) -> str:
        """What the files are built from (a /v1/supervision request), for the export's manifest; known once
        `check` has passed."""
        ...

    def supervise(self, client: TargetClient, input_ids: Tensor, attention_mask: Tensor) -> dict[str, Tensor]:
        """The supervision of a padded batch that `write` builds the files from."""
        ...

    def relative_path(self, index: int) -> Path:
        """Where row `index`'s file goes, under the output directory."""
        ...

    def write(self, row: Row, supervision: Mapping[str, Tensor], info: TargetInfo, file: BinaryIO) -> None:
        """Write row's file from its supervision (trimmed to the row: [S, ...], unshifted)."""
        ...


# --- speculators ------------------------------------------------------------------------------------


def speculators_sample(
    layers: Tensor, final_hidden_prenorm: Tensor, token_ids: Tensor, layer_ids: Sequence[int]
) -> dict[str, Tensor]:
    """One row as vLLM's file holds it: `hidden_states` [S, k+1, H] (`layers` [S, k*H], the layers
    `layer_ids` in that order, sorted ascending, then h_L), `token_ids` [S] int64."""
    seq, hidden = final_hidden_prenorm.shape
    stacked = layers.reshape(seq, len(layer_ids), hidden)
    ascending = sorted(range(len(layer_ids)), key=lambda i: layer_ids[i])
    states = torch.cat((stacked[:, ascending], final_hidden_prenorm.unsqueeze(1)), dim=1)
    return {"hidden_states": states.contiguous(), "token_ids": token_ids.to(torch.int64).contiguous()}


def check_captured(layer_ids: Sequence[int], info: TargetInfo, who: str) -> None:
    """LayoutMismatch naming both sets unless the target captures every layer wanted."""
    missing = [i for i in layer_ids if i not in info.captured_layers]
    if missing:
        raise LayoutMismatch(
            f"{who} needs layers {list(layer_ids)} (vLLM capture ids {vllm_capture_ids(layer_ids)}), but the "
            f"target captures {info.captured_layers} and lacks {missing}: serve it with --capture-layer-ids "
            f"(captureLayerIds) including them, or train on layers it captures"
        )


def speculators_format(layer_ids: Sequence[int], info: TargetInfo) -> str:
    """The request speculators' files for these layers (ours, before h_L) are built from: `hidden_prenorm`
    for the target's aux layers (the EAGLE-3 files, as every server version serves them), else `layers`
    with the pre-norm final state."""
    if sorted(layer_ids) == sorted(info.aux_layer_ids):
        return "hidden_prenorm"
    return f"layers={','.join(map(str, layer_ids)) or 'none'}&final=prenorm"


def fetch_speculators_layers(
    client: TargetClient, input_ids: Tensor, attention_mask: Tensor | None, layer_ids: Sequence[int]
) -> dict[str, Tensor]:
    """`layers` [B, S, k*H] (the layers in `layer_ids` order) and `final_hidden_prenorm` [B, S, H]."""
    info = client.info()
    if speculators_format(layer_ids, info) == "hidden_prenorm":
        out = client.supervise(input_ids, attention_mask, format="hidden_prenorm")
        layers = select_layers(out["aux_hidden_states"], info.aux_layer_ids, layer_ids)
    else:
        out = client.hidden_states(input_ids, attention_mask, layers=layer_ids, final="prenorm")
        final = out["final_hidden_prenorm"]
        layers = out[LAYERS_TENSOR] if layer_ids else final.new_empty(*final.shape[:-1], 0)
    return {"layers": layers, "final_hidden_prenorm": out["final_hidden_prenorm"]}


class SpeculatorsLayout:
    """speculators' files for a draft reading `layer_ids` (our ids), or `method`'s default layers for the
    target's depth; neither: the target's aux layers (the EAGLE-3 draft it was set up for). The last slot
    is always h_L before the final norm: speculators reads it as `verifier_last_hidden_states` and applies
    the final norm itself, whatever the method (so `final` can only be "prenorm")."""

    name = "speculators"

    def __init__(
        self, layer_ids: Sequence[int] | None = None, *, method: str | None = None, final: str | None = None
    ) -> None:
        if method is not None and layer_ids is not None:
            raise ValueError("give either a method or layer ids, not both")
        if final not in (None, "prenorm"):
            raise LayoutMismatch(
                f"speculators' files end with h_L before the final norm (it applies the norm itself): the "
                f"final state must be prenorm, not {final}"
            )
        self._method = None if method is None else methods.method(method)
        self._wanted = None if layer_ids is None else list(layer_ids)
        self._layer_ids: list[int] | None = None
        self._format: str | None = None

    @property
    def layer_ids(self) -> list[int]:
        if self._layer_ids is None:
            raise RuntimeError("the layout's layers are known once check() has seen the target")
        return self._layer_ids

    def check(self, info: TargetInfo) -> None:
        if self._method is not None:
            layer_ids = self._method.default_layer_ids(info.num_hidden_layers)
        else:
            layer_ids = list(info.aux_layer_ids) if self._wanted is None else self._wanted
        if len(set(layer_ids)) != len(layer_ids):
            raise LayoutMismatch(f"layer ids must be distinct, got {layer_ids}")
        # L-1 is h_L, the file's last slot already (vLLM captures it once, as its id L, last).
        layer_ids = sorted(set(layer_ids) - {info.num_hidden_layers - 1})
        who = f"speculators' {self._method.name}" if self._method is not None else "this speculators draft"
        check_captured(layer_ids, info, who)
        self._layer_ids = layer_ids
        self._format = speculators_format(layer_ids, info)

    @property
    def format(self) -> str:
        if self._format is None:
            raise RuntimeError("the layout's request is known once check() has seen the target")
        return self._format

    def supervise(self, client: TargetClient, input_ids: Tensor, attention_mask: Tensor) -> dict[str, Tensor]:
        return fetch_speculators_layers(client, input_ids, attention_mask, self.layer_ids)

    def relative_path(self, index: int) -> Path:
        return Path("hidden_states") / f"hs_{index}.safetensors"

    def write(self, row: Row, supervision: Mapping[str, Tensor], info: TargetInfo, file: BinaryIO) -> None:
        sample = speculators_sample(
            supervision["layers"], supervision["final_hidden_prenorm"], row.input_ids, self.layer_ids
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

    def supervise(self, client: TargetClient, input_ids: Tensor, attention_mask: Tensor) -> dict[str, Tensor]:
        return client.supervise(input_ids, attention_mask, format=self.format)

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
