"""The control plane's child processes: one process group and one log file each, recognisable again from a
state file written by another Python process, and stopped so that nothing survives (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.cluster.waiting import eventually

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_libc = ctypes.CDLL(None, use_errno=True)  # resolved before any fork: the child must not load libraries


class ClusterStartError(RuntimeError):
    """The control plane did not come up; the message names the component and quotes its log."""


@dataclass(frozen=True)
class Process:
    """A component we started. `start_ticks` (from /proc) tells it apart from a later process that reuses
    its pid, so `down` in a new shell never signals a stranger."""

    name: str
    pid: int
    start_ticks: int
    log: Path
    popen: subprocess.Popen[bytes] | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "pid": self.pid, "start_ticks": self.start_ticks, "log": str(self.log)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Process:
        return cls(str(data["name"]), int(data["pid"]), int(data["start_ticks"]), Path(str(data["log"])))

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        stat = _proc_stat(self.pid)
        return stat is not None and stat[0] != "Z" and int(stat[19]) == self.start_ticks


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (index 0 is the state, 19 the start time)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def kill_when_parent_dies() -> None:
    """Runs in the child before exec: the kernel SIGKILLs it when the thread that started it ends
    (PR_SET_PDEATHSIG follows the spawning thread, not the process), so surely when the test process dies."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn(name: str, argv: Sequence[str], log: Path, *, die_with_parent: bool) -> Process:
    """Start `argv` in a new session (its own process group) with stdout and stderr appended to `log`."""
    with log.open("ab") as log_file:
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=kill_when_parent_dies if die_with_parent else None,
        )
    stat = _proc_stat(popen.pid)
    start_ticks = int(stat[19]) if stat is not None else 0
    return Process(name, popen.pid, start_ticks, log, popen)


def stop(processes: Sequence[Process], grace_seconds: float = 10.0) -> None:
    """Stop in reverse start order, each before the next, so that a server is never left waiting on a
    dependency that went first (kube-apiserver takes ~10 s to exit without etcd, ~1 s with it):
    SIGTERM its process group, wait up to `grace_seconds`, then SIGKILL."""
    for process in reversed(processes):
        if process.alive():
            _signal_group(process, signal.SIGTERM)
            deadline = time.monotonic() + grace_seconds
            while process.alive() and time.monotonic() < deadline:
                time.sleep(0.02)
            if process.alive():
                _signal_group(process, signal.SIGKILL)
        if process.popen is not None:
            process.popen.wait()


def terminate(child: subprocess.Popen, grace_seconds: float = 20.0, *, group: bool = False) -> None:
    """Stop one child of ours: SIGTERM (its whole process group if `group`), wait up to `grace_seconds`,
    then SIGKILL. A child that already exited is only reaped."""
    if child.poll() is None:
        send = (lambda signum: os.killpg(child.pid, signum)) if group else child.send_signal
        with contextlib.suppress(ProcessLookupError):
            send(signal.SIGTERM)
        try:
            child.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                send(signal.SIGKILL)
    child.wait()


def _signal_group(process: Process, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


def log_tail(path: Path, lines: int = 20) -> str:
    """The last `lines` lines of a log, read from its end so that a large log costs nothing."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError as error:
        return f"(cannot read {path}: {error})"


def describe_logs(processes: Iterable[Process], lines: int = 20) -> str:
    return "\n".join(
        f"--- {p.name}: {p.log} (last {lines} lines)\n{log_tail(p.log, lines)}" for p in processes
    )


def wait_until(ready: Callable[[], bool], what: str, timeout: float, watched: Sequence[Process]) -> None:
    """Poll `ready` until it holds; fail early, with the log, if a watched process exits meanwhile."""

    def ready_or_dead() -> bool:
        dead = [p for p in watched if not p.alive()]
        if dead:
            raise ClusterStartError(f"{dead[0].name} exited while waiting for {what}\n{describe_logs(dead)}")
        return ready()

    try:
        eventually(ready_or_dead, what, timeout)
    except TimeoutError as error:
        raise ClusterStartError(f"{error}\n{describe_logs(watched)}") from None
