"""Tensor parallelism for the SGLang runner: one worker process per rank, as SGLang's own scheduler
processes run (`sglang/srt/entrypoints/engine.py` starts one per rank; each builds a `ModelRunner` for its
tp_rank and joins the process groups at `server_args.nccl_port`, gloo on CPU and NCCL on CUDA).

Every rank runs each command (set the captured layers, one extend forward) in lockstep: the forwards meet in
SGLang's all-reduces and all-gathers, so the hidden states each rank captures are whole and rank 0's are
sent back. A command that raises on every rank fails that call only: the ranks are still in step and run
the next one. A rank that fails to start, dies, loses its device (`process_lost`) or is left out of step
(it did not answer after another rank failed) ends every rank, and `failure` says why from then on (the
server turns unready and exits on it, so Kubernetes restarts the pod). Tensors come back serialised
(`torch.save` into the pipe), so no shared-memory file is left behind.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eagle3_target.runners.base import ModelRefused, process_lost
from eagle3_target.runners.sglang_rank import KVPool, RankCapture, start_model_runner

# SGLang's CPU thread binding (`srt/utils/numa_utils.py` `init_threads_binding`): without it, every rank
# needs a NUMA node of its own; the runner then gives each rank an equal share of this process's CPUs.
CPU_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"
# On CPU no rank may load NCCL: with a CUDA build of torch (this machine's wheel, a GPU image run with
# --device cpu) SGLang finds NCCL and its `PyNcclCommunicator` then asks CUDA for the cpu device
# (`srt/distributed/parallel_state.py:463`, `device_communicators/pynccl.py:116`); a library that does not
# load makes it stand down as it does on CPU builds (`pynccl.py:72-79`), leaving gloo.
NCCL_PATH_ENV = "SGLANG_NCCL_SO_PATH"
NO_NCCL_ON_CPU = "libnccl-not-used-on-cpu.so"
# SGLang names its shared-memory segments sgl_shm_<kind>_<creator pid>_<random>
# (`srt/utils/stale_shm_cleanup.py:31`) so that a killed process's can be found; a closing rank unlinks its
# own (its TP group's message queue, `device_communicators/shm_broadcast.py:106`), a killed one cannot.
SHM_DIR = Path("/dev/shm")
SGLANG_SHM_PREFIX = "sgl_shm_"
# How long a closing rank may take before it is killed.
CLOSE_TIMEOUT_S = 30.0
# How long the other ranks may take to answer a command once one rank has failed it. Ranks that refuse the
# same batch answer together; one still busy after this waits in a collective for the failed rank, so the
# ranks are out of step for good.
STEP_SKEW_TIMEOUT_S = 60.0


def cpu_shares(cpus: list[int], ranks: int) -> list[list[int]]:
    """Split `cpus` into `ranks` contiguous shares (every rank gets all of them when there are fewer)."""
    if len(cpus) < ranks:
        return [cpus] * ranks
    return [cpus[r * len(cpus) // ranks : (r + 1) * len(cpus) // ranks] for r in range(ranks)]


def _serve(server_args: Any, tp_rank: int, env: dict[str, str], conn: Connection) -> None:
    """A rank's process: start its model runner, report, then run the commands until `close`."""

    os.environ.update(env)
    try:
        shares = os.environ.get(CPU_BIND_ENV, "").split("|")
        if server_args.device == "cpu" and tp_rank < len(shares) and shares[tp_rank]:
            # Each rank's torch threads on its own share (SGLang binds them only with its CPU kernels).
            torch.set_num_threads(len(shares[tp_rank].split(",")))
        rank = RankCapture(start_model_runner(server_args, tp_rank))
        loaded = (rank.dtype, rank.context_len, rank.pool)
    except BaseException as exc:
        traceback.print_exc()  # the whole story to the server's log; the reason to the runner
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", loaded))
    while True:
        command, args = conn.recv()
        try:
            result = getattr(rank, command)(*args)
        except Exception as exc:
            traceback.print_exc()
            lost = process_lost(exc)
            conn.send(("lost" if lost else "error", f"{type(exc).__name__}: {exc}"))
            if lost or command == "close":
                return  # this process can run no more commands
            continue
        if command == "close":
            conn.send(("ok", None))
            return
        # Rank 0's results are the runner's; the other ranks' forwards give the same states.
        payload = None
        if result is not None and (tp_rank == 0 or command == "placement"):
            buffer = io.BytesIO()
            torch.save(result, buffer)
            payload = buffer.getvalue()
        conn.send(("ok", payload))


@dataclass
class _Rank:
    process: BaseProcess
    conn: Connection


class RanksEnded(RuntimeError):
    """The ranks can run no more commands (one died, lost its device or fell out of step): every rank
    has been ended."""


class RanksRefused(RuntimeError):
    """A rank failed the command and every rank answered it (none lost): they are still in step and run the
    next."""


class RankProcesses:
    """The runner's `Ranks` for tensor parallelism: one worker process per rank, driven over pipes."""

    def __init__(self, ranks: list[_Rank], dtype: torch.dtype, context_len: int, pool: KVPool) -> None:
        self._ranks = ranks
        self.dtype = dtype
        self.context_len = context_len
        self.pool = pool
        self._failure: str | None = None

    @classmethod
    def start(cls, server_args: Any) -> RankProcesses:
        """Start `server_args.tp_size` ranks and wait until each has loaded, or one has failed."""
        size = int(server_args.tp_size)
        if not server_args.nccl_port:
            from sglang.srt.utils.network import get_free_port_below_ephemeral

            server_args.nccl_port = get_free_port_below_ephemeral()
        env: dict[str, str] = {}  # for the ranks only; the user's own settings win
        if server_args.device == "cpu":
            shares = cpu_shares(sorted(os.sched_getaffinity(0)), size)
            env[CPU_BIND_ENV] = "|".join(",".join(map(str, share)) for share in shares)
            env[NCCL_PATH_ENV] = NO_NCCL_ON_CPU
        env = {key: value for key, value in env.items() if key not in os.environ}
        context = multiprocessing.get_context("spawn")
        ranks: list[_Rank] = []
        try:
            for tp_rank in range(size):
                parent, child = context.Pipe()
                process = context.Process(
                    target=_serve,
                    args=(server_args, tp_rank, env, child),
                    name=f"sglang-tp{tp_rank}",
                    daemon=True,
                )
                process.start()
                child.close()
                ranks.append(_Rank(process, parent))
            replies = _collect(ranks, "start")
        except BaseException:
            _end(ranks)
            raise
        dtype, context_len, _ = replies[0]
        # Every rank allocates its own share of the KV cache: a batch fits when it fits the smallest.
        pool = KVPool(min(r[2].tokens for r in replies), min(r[2].rows for r in replies), replies[0][2].page)
        return cls(ranks, dtype, context_len, pool)

    @property
    def failure(self) -> str | None:
        """Why the ranks can run no more commands, or None. Also sees a rank that died between commands
        (its process sentinel is ready) before the next command finds it."""
        if self._failure is not None or not self._ranks:
            return self._failure
        ranks = self._ranks
        exited = wait([rank.process.sentinel for rank in ranks], 0)
        if not exited:
            return None
        r = next(r for r, rank in enumerate(ranks) if rank.process.sentinel in exited)
        return f"SGLang tensor-parallel rank {r} has exited"

    def _call(self, command: str, *args: Any) -> list[Any]:
        """Run `command` on every rank in lockstep: each rank's result (only rank 0 sends its forwards').
        A command that a rank refused while every rank answered leaves them running (`RanksRefused`); a rank
        that died, or did not answer after another failed, ends them all (`RanksEnded`), as does anything else
        that stops the call midway (an interrupt, an argument that does not pickle): a rank may have been left
        holding the command, or its reply, so the next call would read a stale one."""
        if not self._ranks:
            raise RanksEnded(
                f"SGLang's tensor-parallel ranks have ended: {self._failure or 'the runner is closed'}"
            )
        try:
            for r, rank in enumerate(self._ranks):
                try:
                    rank.conn.send((command, args))
                except OSError:  # the rank has gone: its pipe is closed
                    rank.process.join(CLOSE_TIMEOUT_S)
                    raise RanksEnded(
                        f"SGLang tensor-parallel rank {r} failed ({command}): it exited with code "
                        f"{rank.process.exitcode}"
                    ) from None
            results = _collect(self._ranks, command)
        except RanksRefused:
            raise
        except BaseException as exc:
            self._failure = (
                str(exc)
                if isinstance(exc, RanksEnded)
                else f"{command} stopped by {type(exc).__name__}: {exc}"
            )
            self._end()
            raise
        return [None if result is None else torch.load(io.BytesIO(result)) for result in results]

    def placements(self) -> list[tuple[int, int, int, list[int]]]:
        return self._call("placement")

    def set_layers(self, layers: list[int]) -> None:
        self._call("set_layers", layers)

    def extend(self, prompts: list[list[int]], prenorm: bool) -> tuple[Tensor, Tensor]:
        final, captured = self._call("extend", prompts, prenorm)[0]
        return final, captured

    def plain_prefill(self, prompts: list[list[int]]) -> None:
        self._call("plain_prefill", prompts)

    def close(self) -> None:
        """Close every rank's model runner and process groups, then end the processes."""
        if not self._ranks:
            return
        try:
            for rank in self._ranks:
                rank.conn.send(("close", ()))
            _collect(self._ranks, "close", timeout=CLOSE_TIMEOUT_S)
        except (ModelRefused, RuntimeError, OSError):
            self._end()
        else:
            self._end(CLOSE_TIMEOUT_S)

    def _end(self, grace_s: float = 0.0) -> None:
        _end(self._ranks, grace_s)
        self._ranks = []


def _collect(ranks: list[_Rank], command: str, timeout: float | None = None) -> list[Any]:
    """Each rank's reply to `command`, waiting until all have replied. At start the first error is raised
    at once (ModelRefused: the other ranks wait for the failed one at the rendezvous); after, the lowest
    rank's error once every rank has answered, whichever answered first (`RanksRefused`). `RanksEnded` when
    a rank died or lost its device, or did not answer within `STEP_SKEW_TIMEOUT_S` of another's error, or
    all of them did not within `timeout`."""
    replies: dict[int, Any] = {}
    errors: dict[int, str] = {}
    lost = False
    while len(replies) < len(ranks):
        waiting = [r for r in range(len(ranks)) if r not in replies]
        limit = STEP_SKEW_TIMEOUT_S if errors and command != "start" else timeout
        ready = wait([ranks[r].conn for r in waiting] + [ranks[r].process.sentinel for r in waiting], limit)
        if not ready:
            if errors:
                first, late = errors[min(errors)], ", ".join(map(str, waiting))
                raise RanksEnded(
                    f"{first}; rank {late} did not answer in {limit} s: the ranks are out of step"
                )
            raise RanksEnded(f"SGLang's tensor-parallel ranks did not finish {command} in {timeout} s")
        for r in waiting:
            rank = ranks[r]
            try:
                reply = rank.conn.recv() if rank.conn in ready or rank.conn.poll() else None
            except (EOFError, OSError):  # the rank has gone, and its end of the pipe with it
                reply = None
            if reply is None:
                if rank.conn not in ready and rank.process.sentinel not in ready:
                    continue
                rank.process.join(CLOSE_TIMEOUT_S)
                message = (
                    f"SGLang tensor-parallel rank {r} failed ({command}): it exited with code "
                    f"{rank.process.exitcode}"
                )
                if command == "start":
                    raise ModelRefused(message)
                raise RanksEnded("; ".join([*(errors[e] for e in sorted(errors)), message]))
            status, value = reply
            if status != "ok":
                errors[r] = f"SGLang tensor-parallel rank {r} failed ({command}): {value}"
                lost = lost or status == "lost"
                if command == "start":  # the others wait for it at the rendezvous: no use waiting for them
                    raise ModelRefused(errors[r])
            replies[r] = value
    if errors:
        first = errors[min(errors)]
        raise RanksEnded(first) if lost else RanksRefused(first)
    return [replies[r] for r in range(len(ranks))]


def _end(ranks: list[_Rank], grace_s: float = 0.0) -> None:
    """End the rank processes (killing any still running after `grace_s`), close the pipes and remove the
    shared-memory segments SGLang left named after them."""
    for rank in ranks:
        rank.process.join(grace_s)
        if rank.process.is_alive():
            rank.process.kill()
        rank.process.join()
        rank.conn.close()
    remove_segments_of({rank.process.pid for rank in ranks if rank.process.pid is not None})


def remove_segments_of(pids: set[int]) -> None:
    """Unlink SGLang's shared-memory segments created by the (ended) processes `pids`."""
    for entry in SHM_DIR.glob(f"{SGLANG_SHM_PREFIX}*"):
        parts = entry.name.split("_")
        if len(parts) >= 4 and parts[-2].isdigit() and int(parts[-2]) in pids:
            entry.unlink(missing_ok=True)
