"""speculators online: a served target as speculators' `HiddenStatesBackend` "eagle3-target".

    python -m eagle3_target.integrations.speculators --hidden-states-backend eagle3-target \\
        --eagle3-target llama31-8b [--eagle3-target-namespace NS] [--eagle3-target-token-file F] \\
        [--eagle3-target-kubeconfig FILE] [--eagle3-target-wait SECONDS] \\
        --on-missing raise <speculators train flags...>

`--eagle3-target` takes a name, or server URLs separated by commas (fail-over): speculators copies only a
backend flag's type and help into its own parser, so a flag given twice would keep only its last value.

speculators' dataset asks the backend for row i's hidden states (`get_cached(i)`); this one computes them
on the served target instead of reading vLLM's file: the same `hidden_states` [S, k+1, H] (the draft's
layers, then h_L before the final norm) and `token_ids`, for any speculator type (eagle3, peagle, dflash,
dspark, mtp), through the `layers` format. The draft's layers must be captured by the target; a draft
that reads others is refused before the first step, naming both sets. Importing this package registers
the backend; `main` (this package's `__main__`) then runs speculators' own training CLI, which reads its
backend choices when it is first imported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from hs_connectors import HiddenStatesBackend, HiddenStatesTransfer

from eagle3_target.client.target_client import TargetClient
from eagle3_target.integrations.connect import Connection
from eagle3_target.integrations.layouts import (
    check_captured,
    fetch_speculators_layers,
    speculators_sample,
)
from eagle3_target.methods import hf_layer_ids
from eagle3_target.protocol import TargetInfo

BACKEND = "eagle3-target"
# Seconds to wait for a named target to be Available: long enough for an idle 70B target to wake and load.
DEFAULT_WAIT_S = 900.0


# The draft config key that holds its target layers (vLLM capture ids), by speculator type.
CONFIG_LAYER_KEYS = ("eagle_aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids")


def draft_layer_ids(args: argparse.Namespace, num_hidden_layers: int) -> list[int]:
    """The vLLM capture ids the draft will be trained (and deployed) with, as speculators resolves them:
    MTP reads only `[L]`; others `--from-pretrained`'s config, else `--target-layer-ids`, else
    `[2, L//2, L-3]`."""
    if getattr(args, "speculator_type", None) == "mtp":
        return [num_hidden_layers]
    pretrained = getattr(args, "from_pretrained", None)
    if pretrained:
        config_file = Path(pretrained) / "config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text())
            for key in CONFIG_LAYER_KEYS:
                if config.get(key) is not None:
                    return list(config[key])
    ids = getattr(args, "target_layer_ids", None)
    if ids:
        return list(ids)
    return [2, num_hidden_layers // 2, num_hidden_layers - 3]


def feature_layer_ids(draft_ids: list[int], info: TargetInfo) -> list[int]:
    """Our ids of the layers in the draft's file before its last slot (h_L): vLLM writes its capture ids
    ascending with L last, once, so L among the draft's ids is that last slot (MTP's `[L]`: none before it).
    ValueError, naming the draft's ids and the target's capture set, unless the target captures them all."""
    last = info.num_hidden_layers
    ids = sorted(set(draft_ids) - {last})
    try:
        layers = hf_layer_ids(ids, last)
        check_captured(layers, info, f"the draft (target layer ids {draft_ids})")
    except ValueError as exc:  # a LayoutMismatch, or vLLM's id 0 (the embeddings)
        raise ValueError(
            f"{exc}; as vLLM capture ids the target captures {[i + 1 for i in info.captured_layers]}"
        ) from None
    return layers


class Eagle3TargetTransfer(HiddenStatesTransfer):
    """Row i's hidden states from the served target. Picklable: each DataLoader worker process opens its own
    client and dataset on first use, and checks it reaches the same model (fingerprint) as the trainer."""

    def __init__(
        self, connection: Connection, data_path: str, info: TargetInfo, layer_ids: list[int]
    ) -> None:
        self.connection = connection
        self.data_path = data_path
        self.layer_ids = layer_ids
        self.fingerprint = info.fingerprint
        self._pid: int | None = None
        self._client: TargetClient | None = None
        self._data: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pid": None, "_client": None, "_data": None}

    def setup(self) -> None:
        if self._pid == os.getpid():
            return
        from datasets import load_from_disk

        client = self.connection.open()
        fingerprint = client.info().fingerprint
        if fingerprint != self.fingerprint:
            client.close()
            raise RuntimeError(
                f"the target now serves another model (fingerprint {fingerprint}, the run started with "
                f"{self.fingerprint}); its hidden states would not match the ones trained on so far"
            )
        self._data = load_from_disk(self.data_path).with_format("torch")
        self._client, self._pid = client, os.getpid()

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor]:
        """`file_idx` is the row of the whole prepare-data dataset (speculators maps split rows to it)."""
        self.setup()
        assert self._client is not None  # setup() opened it
        input_ids = self._data[file_idx]["input_ids"].to(torch.int64)
        out = fetch_speculators_layers(self._client, input_ids.unsqueeze(0), None, self.layer_ids)
        return speculators_sample(out["layers"][0], out["final_hidden_prenorm"][0], input_ids, self.layer_ids)

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        raise RuntimeError(f"the {BACKEND} backend computes every row on the target; it never asks vLLM")


@HiddenStatesBackend.register(BACKEND)
class Eagle3TargetBackend(HiddenStatesBackend):
    """`--hidden-states-backend eagle3-target`: hidden states from a served Eagle3Target."""

    @staticmethod
    def add_train_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--eagle3-target",
            default=None,
            help="Eagle3Target name, or its server URLs (http://...), comma-separated for fail-over",
        )
        parser.add_argument(
            "--eagle3-target-namespace", default=None, help="the target's namespace (default: kubeconfig's)"
        )
        parser.add_argument(
            "--eagle3-target-token-file",
            default=None,
            help="file holding the target's bearer token (read again when the target answers 401)",
        )
        parser.add_argument(
            "--eagle3-target-kubeconfig",
            default=None,
            help="kubeconfig to resolve the name with (default: $KUBECONFIG)",
        )
        parser.add_argument(
            "--eagle3-target-wait",
            type=float,
            default=DEFAULT_WAIT_S,
            help="seconds to wait for a named target to be Available (some endpoint serves its current "
            f"model), waking it if idle; also how long a run waits when it stops serving (default: "
            f"{DEFAULT_WAIT_S:.0f})",
        )

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        """No vLLM to launch: the target is served by eagle3-target."""

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> Eagle3TargetTransfer:
        connection = connection_from_args(args)
        with connection.open() as client:
            info = client.info()
        layer_ids = feature_layer_ids(draft_layer_ids(args, info.num_hidden_layers), info)
        return Eagle3TargetTransfer(connection, data_path, info, layer_ids)

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
        raise RuntimeError(f"the {BACKEND} backend needs no vLLM kv connector")


def connection_from_args(args: argparse.Namespace) -> Connection:
    """The target the `--eagle3-target*` flags name: a resource name, or comma-separated server URLs."""
    target = getattr(args, "eagle3_target", None)
    if not target:
        raise ValueError(f"--hidden-states-backend {BACKEND} needs --eagle3-target NAME (or URLs)")
    token_file = getattr(args, "eagle3_target_token_file", None)
    urls = tuple(url.strip() for url in target.split(",") if url.strip()) if "://" in target else ()
    return Connection(
        target=None if urls else target,
        urls=urls,
        namespace=getattr(args, "eagle3_target_namespace", None),
        token_file=Path(token_file) if token_file else None,
        wait=getattr(args, "eagle3_target_wait", DEFAULT_WAIT_S),
        kubeconfig=getattr(args, "eagle3_target_kubeconfig", None),
    )


def main(argv: list[str] | None = None) -> None:
    """speculators' `train` with this backend registered (speculators reads its backends at import)."""
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    train(TrainConfig.resolve(sys.argv[1:] if argv is None else argv))
