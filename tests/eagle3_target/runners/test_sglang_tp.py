"""Tensor-parallel ranks that fail: a batch every rank refuses fails alone and the ranks run the next one; a
lost device, a rank that fails alone (the others wait for it in a collective) or a rank that dies ends them
all and `failure` says why. The ranks are real spawned processes driven over their pipes; their SGLang model
runner is the fault-injecting stand-in of support/sglang_rank_faults (a real engine cannot be made to lose
its device or fail on one rank only), so these run without SGLang.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import psutil
import pytest
from eagle3_target.runners import sglang_tp
from eagle3_target.runners.sglang_tp import RankProcesses, RanksEnded, RanksRefused

from support.cluster.waiting import eventually, free_port
from support.sglang_rank_faults import faults

GOOD = [[1, 2, 3], [4, 5]]


class Started(NamedTuple):
    ranks: RankProcesses
    processes: list[psutil.Process]  # the rank processes, rank 0 first


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Iterator[Started]:
    """Two ranks whose model runner is the stand-in (every spawned process imports its sitecustomize)."""
    monkeypatch.setenv("PYTHONPATH", str(Path(faults.__file__).parent))
    before = set(live_children())
    ranks = RankProcesses.start(SimpleNamespace(tp_size=2, nccl_port=free_port(), device="cpu"))
    processes = sorted(set(live_children()) - before, key=lambda p: (p.create_time(), p.pid))
    assert len(processes) == 2, processes  # what the tests below see end (or kill) is every rank
    yield Started(ranks, processes)
    ranks.close()


@pytest.fixture
def ranks(started: Started) -> RankProcesses:
    return started.ranks


def assert_serves(ranks: RankProcesses) -> None:
    final, aux = ranks.extend(GOOD, False)
    assert (tuple(final.shape), tuple(aux.shape)) == ((5, faults.HIDDEN), (5, 3 * faults.HIDDEN))
    assert not final.any(), "rank 0's states are the runner's"
    assert ranks.failure is None


def test_a_batch_every_rank_refuses_fails_alone_and_the_ranks_run_the_next(ranks):
    assert ranks.pool == faults.POOL
    assert_serves(ranks)
    for _ in range(2):
        with pytest.raises(
            RanksRefused, match=r"rank 0 failed \(extend\): RuntimeError: Prefill out of memory"
        ):
            ranks.extend([[1, faults.REFUSED_BY_EVERY_RANK]], False)
        assert_serves(ranks)


def test_a_lost_device_ends_every_rank_and_says_why(started, ranks):
    with pytest.raises(RanksEnded, match="AcceleratorError: CUDA error: an illegal memory access"):
        ranks.extend([[faults.DEVICE_LOST]], False)
    assert "illegal memory access" in (ranks.failure or "")
    assert not [p for p in started.processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    with pytest.raises(RanksEnded, match=r"ranks have ended: .*illegal memory access"):
        ranks.extend(GOOD, False)


def test_a_rank_that_fails_alone_leaves_the_ranks_out_of_step_and_ends_them(ranks, monkeypatch):
    monkeypatch.setattr(sglang_tp, "STEP_SKEW_TIMEOUT_S", 1.0)
    with pytest.raises(RanksEnded, match=r"rank 1 failed \(extend\).*rank 0 did not answer .*out of step"):
        ranks.extend([[faults.FAILED_BY_RANK_1]], False)
    assert "out of step" in (ranks.failure or "")
    with pytest.raises(RanksEnded, match="ranks have ended"):
        ranks.extend(GOOD, False)


class PicklesOnce:
    """A token that reaches rank 0 only: pickling it for rank 1 fails, so rank 0 runs a batch rank 1 never
    gets, and rank 0's reply waits in its pipe."""

    def __init__(self) -> None:
        self.sent = 0

    def __reduce__(self):
        self.sent += 1
        if self.sent > 1:
            raise pickle.PicklingError("pickled for rank 0 only")
        return (int, (1,))


def test_a_call_stopped_midway_ends_every_rank_rather_than_leave_a_stale_reply(started, ranks):
    with pytest.raises(pickle.PicklingError, match="rank 0 only"):
        ranks.extend([[2, PicklesOnce()]], False)
    assert ranks.failure == "extend stopped by PicklingError: pickled for rank 0 only"
    assert not [p for p in started.processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    with pytest.raises(RanksEnded, match="ranks have ended: extend stopped by PicklingError"):
        ranks.extend(GOOD, False)


def test_a_rank_that_died_between_batches_is_the_failure_before_the_next_batch(started, ranks):
    assert_serves(ranks)
    started.processes[1].kill()
    assert (
        eventually(lambda: ranks.failure, "the dead rank seen") == "SGLang tensor-parallel rank 1 has exited"
    )
    with pytest.raises(RanksEnded, match=r"rank 1 failed \(extend\): it exited"):
        ranks.extend(GOOD, False)
    assert "rank 1 failed (extend)" in (ranks.failure or "")


def live_children() -> list[psutil.Process]:
    """This process's live children but multiprocessing's resource tracker (one per interpreter)."""
    return [
        p
        for p in psutil.Process().children()
        if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline())
    ]
