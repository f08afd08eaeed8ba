"""Export a served target's supervision as another trainer's feature files, one file per input row.

Behaves like a data tool should:
- resumable: a file that exists is complete (each is written under a temporary name, synced, then renamed),
  so a rerun skips it; a manifest pins the target's fingerprint so a rerun never mixes two models' files;
- one exporter per directory (an exclusive lock), so leftover temporary files can be swept safely;
- rows are packed into requests of up to the server's `max_batch_tokens` (sorted by length within a bounded
  window, so little is padding) and `depth` requests are in flight while a response's files are written,
  so the server is never kept waiting by the disk; a response's files are written `WRITERS` at a time, so
  their syncs share the filesystem's journal commits instead of waiting for one commit each;
- memory stays bounded: a window of token ids and `depth` + 1 responses;
- requests fail over across the target's endpoints (the `TargetClient`), and a row the server cannot take
  is refused before the first request;
- a progress bar with tokens/s, and a summary at the end.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from eagle3_target.client.errors import RequestRejected
from eagle3_target.client.prefetch import prefetch
from eagle3_target.client.target_client import TargetClient
from eagle3_target.integrations.layouts import Layout
from eagle3_target.integrations.rows import Row, RowSource
from eagle3_target.protocol import TargetInfo

MANIFEST = "eagle3-target-export.json"
LOCK = ".eagle3-target-export.lock"
PARTIAL_SUFFIX = ".partial"
# Rows are sorted by length within windows of this many requests' worth of tokens.
WINDOW_BATCHES = 8
# Files written (and synced) at once: concurrent fsyncs of a response's files share journal commits.
WRITERS = 4
# The target facts a manifest pins: files written against other values would not belong together.
PINNED_INFO = ("fingerprint", "model", "revision", "dtype", "hidden_size", "aux_layer_ids")


class ExportError(RuntimeError):
    """The export cannot start or go on; the message says why and what to do."""


@dataclass(frozen=True)
class ExportSummary:
    rows: int
    rows_written: int
    rows_already_there: int
    tokens_written: int
    bytes_written: int
    seconds: float
    requests: int
    retries: int
    out_dir: str

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_written / self.seconds if self.seconds > 0 else 0.0

    def describe(self) -> str:
        return (
            f"exported {self.rows_written} rows ({self.tokens_written} tokens, "
            f"{self.bytes_written / 2**20:.1f} MiB) to {self.out_dir} in {self.seconds:.1f}s: "
            f"{self.tokens_per_s:.0f} tokens/s; {self.rows_already_there} of {self.rows} rows were already "
            f"there; {self.requests} requests, {self.retries} retried"
        )


def row_limit(info: TargetInfo, batch_tokens: int) -> int:
    """The longest row the target takes in one request."""
    return min(info.max_model_len, batch_tokens)


def check_lengths(lengths: Sequence[int], limit: int, info: TargetInfo) -> None:
    too_long = [i for i, n in enumerate(lengths) if n > limit]
    if too_long:
        shown = ", ".join(f"row {i} ({lengths[i]} tokens)" for i in too_long[:5])
        raise ExportError(
            f"{len(too_long)} rows are longer than the target accepts ({limit} tokens: max_model_len "
            f"{info.max_model_len}, max_batch_tokens {info.max_batch_tokens}): {shown}; "
            "truncate or drop them"
        )


def pack(rows: Iterator[Row], batch_tokens: int) -> Iterator[list[Row]]:
    """Requests of at most `batch_tokens` padded tokens (rows x longest row), longest rows first within
    each window of `WINDOW_BATCHES` requests' worth of rows."""
    window: list[Row] = []
    window_tokens = 0

    def flush() -> Iterator[list[Row]]:
        window.sort(key=lambda r: -r.input_ids.numel())
        batch: list[Row] = []
        for row in window:
            longest = batch[0].input_ids.numel() if batch else row.input_ids.numel()
            if batch and (len(batch) + 1) * longest > batch_tokens:
                yield batch
                batch = []
            batch.append(row)
        if batch:
            yield batch

    for row in rows:
        window.append(row)
        window_tokens += row.input_ids.numel()
        if window_tokens >= WINDOW_BATCHES * batch_tokens:
            yield from flush()
            window, window_tokens = [], 0
    yield from flush()


def padded(batch: Sequence[Row]) -> tuple[Tensor, Tensor]:
    """Right-padded input_ids and attention_mask [B, longest]."""
    longest = max(r.input_ids.numel() for r in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.int64)
    mask = torch.zeros(len(batch), longest, dtype=torch.int64)
    for i, row in enumerate(batch):
        n = row.input_ids.numel()
        ids[i, :n] = row.input_ids
        mask[i, :n] = 1
    return ids, mask


def write_atomically(path: Path, write: Any) -> int:
    """`write(file)` into a temporary file beside `path`, fsync, rename over `path`; returns its size."""

    def partial() -> tuple[int, str]:
        return tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=PARTIAL_SUFFIX)

    try:
        fd, tmp = partial()
    except FileNotFoundError:  # the first file of its directory: no mkdir call for every other file
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = partial()
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
            size = file.tell()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return size


@contextlib.contextmanager
def exclusive(out_dir: Path) -> Iterator[None]:
    """Hold the directory's export lock; another exporter on it is refused, not interleaved."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / LOCK).open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ExportError(f"another export is writing to {out_dir}") from None
        yield


def sweep_partials(out_dir: Path) -> int:
    """Delete temporary files an interrupted export left (safe: we hold the lock)."""
    swept = 0
    for path in out_dir.rglob(f"*{PARTIAL_SUFFIX}"):
        path.unlink()
        swept += 1
    return swept


def pin_manifest(out_dir: Path, layout: Layout, info: TargetInfo, data: str) -> None:
    """Record what the files are; refuse a directory that holds another target's or trainer's files."""
    wanted = {
        "layout": layout.name,
        "format": layout.format,
        "target": info.model_dump(include=set(PINNED_INFO)),
    }
    path = out_dir / MANIFEST
    if path.exists():
        existing = json.loads(path.read_text())
        found = {
            "layout": existing.get("layout"),
            "format": existing.get("format"),
            "target": existing.get("target"),
        }
        if found != wanted:
            raise ExportError(
                f"{out_dir} holds files exported from another target or for another trainer ({path}: "
                f"{json.dumps(found)}; now {json.dumps(wanted)}); use a new --out directory"
            )
        return
    text = json.dumps({**wanted, "data": data}, indent=2) + "\n"
    write_atomically(path, lambda file: file.write(text.encode()))


def export(
    client: TargetClient,
    source: RowSource,
    layout: Layout,
    out_dir: Path,
    *,
    batch_tokens: int | None = None,
    depth: int = 2,
    progress: bool = True,
) -> ExportSummary:
    """Write `layout`'s file for every row of `source` that is not in `out_dir` yet."""
    started = time.monotonic()
    # Counted from the start: the summary's requests and retries include the info request and its fail-over.
    stats_before = dict(client.stats)
    info = client.info()
    layout.check(info)
    server_max = info.max_batch_tokens
    batch_tokens = server_max if batch_tokens is None else min(batch_tokens, server_max)
    lengths = source.scan()
    check_lengths(lengths, row_limit(info, batch_tokens), info)
    with exclusive(out_dir):
        sweep_partials(out_dir)
        pin_manifest(out_dir, layout, info, str(getattr(source, "path", "")))
        wanted = [not (out_dir / layout.relative_path(i)).exists() for i in range(len(lengths))]
        todo_tokens = sum(n for n, w in zip(lengths, wanted, strict=True) if w)

        def fetch(batch: list[Row]) -> tuple[list[Row], dict[str, Tensor]]:
            ids, mask = padded(batch)
            try:
                return batch, layout.supervise(client, ids, mask)
            except RequestRejected as exc:
                indices = sorted(r.index for r in batch)
                raise ExportError(f"the target refused rows {indices}: {exc}") from exc

        def write(row: Row, out: dict[str, Tensor], i: int) -> int:
            n = row.input_ids.numel()
            tensors = {name: t[i, :n] for name, t in out.items()}
            path = out_dir / layout.relative_path(row.index)
            return write_atomically(path, lambda file: layout.write(row, tensors, info, file))

        rows_written = tokens_written = bytes_written = 0
        bar = tqdm(
            total=todo_tokens, unit="tok", unit_scale=True, desc=f"export {layout.name}", disable=not progress
        )
        # The files are written here, not in the fetching threads: while they are, `depth` requests stay
        # in flight, so the server is never left idle waiting for the next one.
        responses = prefetch(fetch, pack(source.rows(wanted), batch_tokens), depth)
        try:
            with bar, ThreadPoolExecutor(WRITERS, "eagle3-export-write") as pool:
                for batch, out in responses:
                    sizes = list(pool.map(write, batch, [out] * len(batch), range(len(batch))))
                    rows_written += len(batch)
                    tokens = sum(r.input_ids.numel() for r in batch)
                    tokens_written += tokens
                    bytes_written += sum(sizes)
                    bar.update(tokens)
                    bar.set_postfix(rows=rows_written, refresh=False)
        finally:
            responses.close()  # after a failed write: the requests still in flight are stopped
    stats = {k: client.stats[k] - stats_before.get(k, 0) for k in client.stats}
    return ExportSummary(
        rows=len(lengths),
        rows_written=rows_written,
        rows_already_there=len(lengths) - sum(wanted),
        tokens_written=tokens_written,
        bytes_written=bytes_written,
        seconds=time.monotonic() - started,
        requests=stats.get("requests", 0),
        retries=sum(v for k, v in stats.items() if k == "connection_errors" or k.startswith("status_")),
        out_dir=str(out_dir),
    )
