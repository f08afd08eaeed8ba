"""The model load as users see it: its phase and progress (the body of /readyz's 503), the wait for weights
that are still arriving, and the one line a failed load ends the server with.

A load either succeeds, waits (weights still being copied in: the one condition that passes by itself) or
fails. A failure ends the process with that line in the container's termination log, so Kubernetes shows
it at once and restarts the container with back-off, instead of a pod that runs but never turns ready.
"""

from __future__ import annotations

import contextlib
import json
import logging
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from eagle3_target.protocol import LoadPhase, LoadProgress
from eagle3_target.runners import ModelRefused, check_engine_args

log = logging.getLogger(__name__)

WEIGHTS_POLL_SECONDS = 2.0
# The kubelet keeps at most 4096 bytes of a termination message.
TERMINATION_MESSAGE_LIMIT = 4096
CONFIG = "config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Weight files as transformers and vLLM look for them: an index of shards, or one file.
WEIGHT_INDEXES = (SAFETENSORS_INDEX, "pytorch_model.bin.index.json")
SINGLE_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# transformers' progress bar over the tensors it loads (its weight loader, transformers 5.20).
TRANSFORMERS_WEIGHTS_BAR = "Loading weights"


class LoadFailed(Exception):
    """A load that no waiting can fix. The message is the line the server ends with: what, then what to do."""


_Progress = tuple[LoadPhase, str, int | None, int | None]  # phase, message, done, total


class LoadTracker:
    """The load's current phase and progress: the loader thread writes, request handlers read.

    Each update replaces one tuple, so a reader never sees a phase with another phase's counts.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._started = clock()
        self._current: _Progress = (LoadPhase.STARTING, "starting", None, None)

    def update(
        self, phase: LoadPhase, message: str, done: int | None = None, total: int | None = None
    ) -> None:
        if phase is not self._current[0]:
            log.info("load: %s", message, extra={"phase": phase.value})
        self._current = (phase, message, done, total)

    def fail(self, line: str) -> None:
        self.update(LoadPhase.FAILED, line)

    @property
    def failure(self) -> str | None:
        phase, message, _, _ = self._current
        return message if phase is LoadPhase.FAILED else None

    def snapshot(self) -> LoadProgress:
        phase, message, done, total = self._current
        elapsed = round(self._clock() - self._started, 1)
        return LoadProgress(phase=phase, message=message, done=done, total=total, elapsed_seconds=elapsed)


def check_model_dir(model: str) -> Path:
    """The model directory, or LoadFailed when there is none: a missing path or one without config.json
    does not fix itself (weights still being copied in are waited for, see `weights_pending`)."""
    path = Path(model)
    action = "point --model at the directory that holds config.json and the weights (check the volume)"
    if not path.exists():
        raise LoadFailed(f"model directory {path} does not exist; {action}")
    if not path.is_dir():
        raise LoadFailed(f"model path {path} is not a directory; {action}")
    config = path / CONFIG
    if not config.is_file():
        raise LoadFailed(f"{path} has no {CONFIG}, so it is not a Hugging Face model directory; {action}")
    try:
        json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise LoadFailed(f"{config} is not readable JSON ({exc}); {action}") from None
    return path


def preflight(model: str, engine: str, engine_kwargs: dict[str, object]) -> None:
    """What can be refused before anything loads: the model directory and the engine arguments."""
    check_model_dir(model)
    try:
        check_engine_args(engine, engine_kwargs)
    except ModelRefused as exc:
        raise LoadFailed(str(exc)) from None


def weights_pending(path: Path) -> str | None:
    """Why the weights in `path` are not complete yet (None once they are): no weight file yet, shards the
    index lists that are missing, or a safetensors file shorter than its own header says."""
    index = next((path / name for name in WEIGHT_INDEXES if (path / name).is_file()), None)
    if index is not None:
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError):
            return f"{index.name} is still being written"
        files = [path / shard for shard in shards]
        present = [f for f in files if f.is_file()]
        if len(present) < len(files):
            missing = next(f.name for f in files if not f.is_file())
            return f"{len(present)} of {len(files)} weight files present (waiting for {missing})"
    else:
        files = [path / name for name in SINGLE_WEIGHT_FILES if (path / name).is_file()]
        if not files:
            return f"no weights yet (no {' or '.join(SINGLE_WEIGHT_FILES + WEIGHT_INDEXES)})"
    for file in files:
        short = _safetensors_shortfall(file)
        if short is not None:
            return f"{file.name} is still being written ({short})"
    return None


def _safetensors_shortfall(file: Path) -> str | None:
    """How far a safetensors file is from the size its header declares; None when complete (or not one)."""
    if file.suffix != ".safetensors":
        return None
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes"
        (header_len,) = struct.unpack("<Q", head)
        header = f.read(header_len)
    if len(header) < header_len:
        return f"{size} bytes, header incomplete"
    try:
        entries = json.loads(header)
        ends = (entry["data_offsets"][1] for key, entry in entries.items() if key != "__metadata__")
        end = max(ends, default=0)
    except (ValueError, KeyError, TypeError, IndexError):
        return None  # not a header we can read: the loader gives the real error
    expected = 8 + header_len + int(end)
    return None if size >= expected else f"{size} of {expected} bytes"


def wait_for_weights(path: Path, tracker: LoadTracker, poll_seconds: float = WEIGHTS_POLL_SECONDS) -> None:
    """Block while the weights are still arriving (a copy or download into the volume is under way)."""
    while (pending := weights_pending(path)) is not None:
        tracker.update(LoadPhase.WAITING_FOR_WEIGHTS, f"waiting for weights: {pending}")
        time.sleep(poll_seconds)


@contextlib.contextmanager
def weight_loading_progress(tracker: LoadTracker, message: str) -> Iterator[None]:
    """Report transformers' own count of the tensors it loads as `message n/m tensors` while inside."""
    from transformers.utils import logging as transformers_logging

    def hook(factory: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        bar = factory(*args, **kwargs)
        if kwargs.get("desc") != TRANSFORMERS_WEIGHTS_BAR or not args or not hasattr(args[0], "__len__"):
            return bar
        return _CountingBar(
            bar,
            len(args[0]),
            lambda done, total: tracker.update(
                LoadPhase.LOADING, f"{message} {done}/{total} tensors", done, total
            ),
        )

    previous = transformers_logging.set_tqdm_hook(hook)
    try:
        yield
    finally:
        transformers_logging.set_tqdm_hook(previous)


class _CountingBar:
    """A progress bar that also reports each item done to a callback."""

    def __init__(self, bar: Any, total: int, report: Callable[[int, int], None]) -> None:
        self._bar = bar
        self._total = total
        self._report = report

    def __iter__(self) -> Iterator[Any]:
        self._report(0, self._total)
        for done, item in enumerate(self._bar, start=1):
            yield item
            self._report(done, self._total)

    def __enter__(self) -> _CountingBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bar, name)


def failure_line(exc: BaseException) -> str:
    """The one line a failed load ends the server with: what went wrong and what to do about it."""
    if isinstance(exc, LoadFailed):
        line = str(exc)
    elif isinstance(exc, ModelRefused):
        line = f"the engine refused the model: {exc}"
    else:
        line = f"model load failed: {type(exc).__name__}: {exc}; the server log has the traceback"
    return one_line(line)


def one_line(text: str) -> str:
    """`text` as one line, whatever it looked like, cut to what the kubelet keeps of a termination message."""
    return " ".join(text.split()).encode()[:TERMINATION_MESSAGE_LIMIT].decode(errors="ignore")


def write_termination_message(path: Path, line: str) -> None:
    """Write `line` to the container's termination log. Kubernetes creates that file in every container, so
    a missing one means no kubelet reads it (a local run): nothing is written then."""
    if not path.is_file():
        return
    try:
        path.write_text(line + "\n")
    except OSError as exc:
        log.warning("cannot write the termination message to %s: %s", path, exc)
