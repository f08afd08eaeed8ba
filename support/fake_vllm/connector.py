"""The stand-in's capture files, written as vLLM 0.33's `ExampleHiddenStatesConnector` writes them.

The lock file is taken exclusively in the step that schedules a request, before its output is returned;
the file is written one engine step after the request finished, in a writer thread, and the write releases
the lock. A failed write is only logged by vLLM: the lock is released and no file appears. The readers'
helpers are the connector module's own (`load_hidden_states`, `cleanup_hidden_states`).
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass

from safetensors.torch import load_file, save_file
from torch import Tensor


def load_hidden_states(path: str) -> dict[str, Tensor]:
    """Module helper `load_hidden_states`: a shared flock on `path + ".lock"` (sleeps until the writer
    releases LOCK_EX), then `safetensors.torch.load_file(path, device="cpu")`."""
    with open(path + ".lock") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_SH)
        return load_file(path, device="cpu")


def cleanup_hidden_states(path: str, keep_hidden_states: bool = False) -> None:
    """Module helper `cleanup_hidden_states`: removes the lock file, then (unless kept) the file."""
    lock_path = path + ".lock"
    if os.path.exists(lock_path):
        os.remove(lock_path)
    if not keep_hidden_states and os.path.exists(path):
        os.remove(path)


def hold_lock(filename: str) -> int:
    """`wait_for_save`, in the step that schedules the request: the lock file exists and is held (LOCK_EX);
    the returned descriptor keeps it until the write ends."""
    os.makedirs(os.path.dirname(filename), exist_ok=True)
    lock_fd = os.open(filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    return lock_fd


@dataclass
class PendingSave:
    """`PendingSave`: a finished request whose states the worker writes in a later step."""

    filename: str
    lock_fd: int
    tensors: dict[str, Tensor]
    fail: bool = False
    stall: bool = False


def write_tensors(save: PendingSave) -> None:
    """`ExampleHiddenStatesConnector._write_tensors`: save, then close the fd holding LOCK_EX. A failed
    write is only logged by vLLM (`_on_write_done`): the lock is released and no file appears."""
    try:
        if save.fail:
            raise OSError("No space left on device")
        save_file(save.tensors, save.filename)
    finally:
        os.close(save.lock_fd)
