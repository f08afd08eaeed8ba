"""Pre-tokenised training rows (`input_ids` + `loss_mask`), read from JSONL or a speculators `prepare-data`
directory. Row i of the input becomes feature file i, so a row's index is its identity across runs.

A scan records every row's length before any request is sent (and, for JSONL, checks every row): a
malformed or too-long row fails the export at once, not hours in, and the progress bar knows the total.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


class RowError(ValueError):
    """The input data cannot be exported as it is; the message names the row."""


@dataclass(frozen=True)
class Row:
    index: int
    input_ids: Tensor  # [S] int64
    loss_mask: Tensor  # [S] int64, 0/1


def check_row(where: str, input_ids: Any, loss_mask: Any) -> tuple[Tensor, Tensor]:
    """(input_ids, loss_mask) as int64 tensors, or RowError saying what is wrong with them."""
    try:
        ids = torch.as_tensor(input_ids)
        mask = torch.as_tensor(loss_mask)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise RowError(f"{where}: input_ids and loss_mask must be lists of integers ({exc})") from exc
    if ids.numel() == 0:
        raise RowError(f"{where}: input_ids is empty")
    for name, t in (("input_ids", ids), ("loss_mask", mask)):
        if t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise RowError(f"{where}: {name} must be a flat list of integers")
    if mask.shape != ids.shape:
        raise RowError(f"{where}: loss_mask has {mask.numel()} entries, input_ids {ids.numel()}")
    if bool(((mask != 0) & (mask != 1)).any()):
        raise RowError(f"{where}: loss_mask must hold only 0 and 1")
    return ids.to(torch.int64), mask.to(torch.int64)


class JsonlRows:
    """One JSON object per line with `input_ids` and `loss_mask`; blank lines are not rows."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _records(self) -> Iterator[tuple[str, dict[str, Any]]]:
        with self.path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                where = f"{self.path}:{number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise RowError(f"{where}: not JSON ({exc.msg})") from exc
                if not isinstance(record, dict) or not {"input_ids", "loss_mask"} <= record.keys():
                    raise RowError(f"{where}: a row is an object with 'input_ids' and 'loss_mask'")
                yield where, record

    def scan(self) -> list[int]:
        """Every row's length, in order; RowError at the first malformed row."""
        lengths = []
        for where, record in self._records():
            ids, _ = check_row(where, record["input_ids"], record["loss_mask"])
            lengths.append(ids.numel())
        return lengths

    def rows(self, wanted: Sequence[bool]) -> Iterator[Row]:
        """The rows whose `wanted[index]` is set, in order."""
        for index, (where, record) in enumerate(self._records()):
            if index < len(wanted) and wanted[index]:
                ids, mask = check_row(where, record["input_ids"], record["loss_mask"])
                yield Row(index, ids, mask)


class PreparedRows:
    """speculators' `prepare-data` output: a `datasets.save_to_disk` directory with `input_ids`, `loss_mask`
    and `seq_len`. Its row index is the `hs_{i}` file index speculators' loader asks for."""

    def __init__(self, path: Path) -> None:
        try:
            from datasets import load_from_disk
        except ImportError as exc:
            raise RowError(f"reading {path} (a prepare-data directory) needs the `datasets` package") from exc
        dataset = load_from_disk(str(path))
        missing = {"input_ids", "loss_mask"} - set(dataset.column_names)
        if missing:
            raise RowError(f"{path}: not a speculators prepare-data directory (no column {sorted(missing)})")
        self.path = path
        self._data = dataset.with_format("torch")

    def scan(self) -> list[int]:
        if "seq_len" in self._data.column_names:
            return [int(n) for n in self._data.with_format(None)["seq_len"]]
        return [len(ids) for ids in self._data.with_format(None)["input_ids"]]

    def rows(self, wanted: Sequence[bool]) -> Iterator[Row]:
        for index, flag in enumerate(wanted):
            if flag:
                record = self._data[index]
                ids, mask = check_row(f"{self.path} row {index}", record["input_ids"], record["loss_mask"])
                yield Row(index, ids, mask)


RowSource = JsonlRows | PreparedRows


def open_rows(path: Path) -> RowSource:
    """A JSONL file, or a speculators prepare-data directory."""
    if path.is_dir():
        return PreparedRows(path)
    if path.is_file():
        return JsonlRows(path)
    raise RowError(f"{path} does not exist")
