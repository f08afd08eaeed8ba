"""The engine worker without a server: its bounded queue, coalescing, and failures kept to their request."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from eagle3_target.server.batching import EngineJob, EngineWorker, QueueFull, run_coalesced
from eagle3_target.server.metrics import ServerMetrics

from support.cluster.waiting import eventually
from support.engine_jobs import Blocker, double


def job(rows: int, seq: int, start: int, key: object = "k") -> EngineJob:
    ids = torch.arange(start, start + rows * seq).reshape(rows, seq)
    return EngineJob(batch_key=key, inputs={"input_ids": ids}, compute=double)


def test_run_coalesced_splits_rows_back():
    jobs = [job(1, 3, 0), job(2, 3, 100), job(3, 3, 1000)]
    results = run_coalesced(jobs)
    for j, result in zip(jobs, results, strict=True):
        assert torch.equal(result["doubled"], j.inputs["input_ids"] * 2)
        assert torch.equal(result["row_sum"], j.inputs["input_ids"].sum(dim=1))


def test_worker_coalesces_compatible_jobs_and_bounds_the_queue():
    metrics = ServerMetrics()
    worker = EngineWorker(max_queue=3, max_batch_tokens=12, metrics=metrics)
    blocker = Blocker()
    calls: list[int] = []

    def counting(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        calls.append(int(inputs["input_ids"].shape[0]))
        return double(inputs)

    worker.start()
    try:
        first = worker.submit(blocker.job)
        assert blocker.running.wait(timeout=30)
        queued = [job(1, 4, 0), job(2, 4, 100), job(1, 4, 200)]
        for j in queued:
            j.compute = counting
        futures = [worker.submit(j) for j in queued]
        assert metrics.registry.get_sample_value("eagle3_queue_depth") == 3
        with pytest.raises(QueueFull, match="3 requests waiting"):
            worker.submit(job(1, 4, 300))
        blocker.release.set()
        assert torch.equal(first.result(timeout=30).wait()["doubled"], torch.zeros(1, 1, dtype=torch.int64))
        for j, future in zip(queued, futures, strict=True):
            assert torch.equal(future.result(timeout=30).wait()["doubled"], j.inputs["input_ids"] * 2)
        # 12 tokens fit: the first two (4 + 8) share one call, the third runs alone.
        assert calls == [3, 1]
    finally:
        blocker.release.set()
        worker.stop()


def test_worker_keeps_keys_and_lengths_apart_and_survives_errors():
    worker = EngineWorker(max_queue=8, max_batch_tokens=1000, metrics=ServerMetrics())

    def failing(_inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise RuntimeError("engine exploded")

    worker.start()
    try:
        bad = EngineJob(
            batch_key="bad", inputs={"input_ids": torch.zeros(1, 2, dtype=torch.int64)}, compute=failing
        )
        futures = [
            worker.submit(bad),
            worker.submit(job(1, 2, 0, key="a")),
            worker.submit(job(1, 3, 10, key="a")),
        ]
        with pytest.raises(RuntimeError, match="exploded"):
            futures[0].result(timeout=30)
        assert futures[1].result(timeout=30).wait()["doubled"].shape == (1, 2)
        assert futures[2].result(timeout=30).wait()["doubled"].shape == (1, 3)
    finally:
        worker.stop()


def test_a_failing_request_does_not_fail_the_requests_it_shares_a_batch_with():
    metrics = ServerMetrics()
    worker = EngineWorker(max_queue=8, max_batch_tokens=1000, metrics=metrics)
    blocker = Blocker()
    rows_per_call: list[int] = []

    def refuses_negative_ids(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rows_per_call.append(int(inputs["input_ids"].shape[0]))
        if bool((inputs["input_ids"] < 0).any()):
            raise ValueError("negative token id")
        return double(inputs)

    worker.start()
    try:
        worker.submit(blocker.job)
        assert blocker.running.wait(timeout=30)
        good = [job(1, 3, 0), job(1, 3, 10)]
        poison = EngineJob(
            batch_key="k", inputs={"input_ids": -torch.ones(1, 3, dtype=torch.int64)}, compute=double
        )
        for j in (*good, poison):
            j.compute = refuses_negative_ids
        futures = [worker.submit(good[0]), worker.submit(poison), worker.submit(good[1])]
        blocker.release.set()
        with pytest.raises(ValueError, match="negative"):
            futures[1].result(timeout=30)
        for j, future in zip(good, (futures[0], futures[2]), strict=True):
            assert torch.equal(future.result(timeout=30).wait()["doubled"], j.inputs["input_ids"] * 2)
        # The three really shared one engine call (one 9-token batch after the 1-token blocker), and
        # only its failure sent them back one at a time.
        assert rows_per_call == [3, 1, 1, 1]
        assert metrics.registry.get_sample_value("eagle3_batch_tokens_count") == 2
        assert metrics.registry.get_sample_value("eagle3_batch_tokens_sum") == 1 + 9
    finally:
        blocker.release.set()
        worker.stop()


def test_host_outputs_of_a_cpu_engine_are_its_own_tensors_with_nothing_to_wait_for():
    produced: list[torch.Tensor] = []

    def remember(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        produced.append(inputs["input_ids"] * 3)
        return {"tripled": produced[-1]}

    worker = EngineWorker(max_queue=4, max_batch_tokens=64, metrics=ServerMetrics())
    worker.start()
    try:
        j = job(2, 3, 0)
        j.compute = remember
        outputs = worker.submit(j).result(timeout=30)
    finally:
        worker.stop()
    assert not outputs.pending and outputs.copied is None
    assert outputs.wait()["tripled"] is produced[0]  # no copy on the way to the response


def test_stop_fails_the_waiting_jobs_and_skips_the_cancelled_ones():
    """A request gone while its job waited has cancelled its future; stopping must not trip over it (the
    later jobs still learn of the shutdown and the thread ends, so the engine can be closed)."""
    worker = EngineWorker(max_queue=4, max_batch_tokens=64, metrics=ServerMetrics())
    blocker = Blocker()
    worker.start()
    first = worker.submit(blocker.job)
    assert blocker.running.wait(timeout=30)
    cancelled, waiting = worker.submit(job(1, 4, 0)), worker.submit(job(1, 4, 100))
    assert cancelled.cancel()
    stopping = threading.Thread(target=worker.stop)
    stopping.start()
    blocker.release.set()
    stopping.join(timeout=30)
    assert not stopping.is_alive() and not worker._thread.is_alive()
    assert first.result(timeout=5).wait()["doubled"].tolist() == [[0]]
    assert cancelled.cancelled()
    with pytest.raises(RuntimeError, match="server shutting down"):
        waiting.result(timeout=5)


def test_a_job_cancelled_while_it_waits_leaves_the_queue_and_never_runs():
    """Its client left: the job frees its place in the queue at once, for a live request, and the engine
    never computes it."""
    metrics = ServerMetrics()
    worker = EngineWorker(max_queue=1, max_batch_tokens=64, metrics=metrics)
    blocker = Blocker()
    ran: list[int] = []

    def counting(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ran.append(int(inputs["input_ids"][0, 0]))
        return double(inputs)

    worker.start()
    try:
        worker.submit(blocker.job)
        assert blocker.running.wait(timeout=30)
        dropped, live = job(1, 4, 0), job(1, 4, 100)
        dropped.compute = live.compute = counting
        assert worker.submit(dropped).cancel()
        assert metrics.registry.get_sample_value("eagle3_queue_depth") == 0
        future = worker.submit(live)  # the queue of one has room again
        blocker.release.set()
        assert torch.equal(future.result(timeout=30).wait()["doubled"], live.inputs["input_ids"] * 2)
    finally:
        blocker.release.set()
        worker.stop()
    assert ran == [100]
    assert metrics.registry.get_sample_value("eagle3_batch_tokens_count") == 2  # the blocker and the live one


def test_an_answer_is_freed_as_soon_as_its_request_lets_go_of_it():
    """Neither the engine thread (waiting for the next batch) nor a reference cycle (left for the garbage
    collector, which may not run for minutes) keeps an answer's memory once its response is done with it."""
    worker = EngineWorker(max_queue=4, max_batch_tokens=64, metrics=ServerMetrics())
    worker.start()
    gc.disable()
    try:
        outputs = worker.submit(job(2, 3, 0)).result(timeout=30).wait()
        answer = weakref.ref(outputs["doubled"])
        del outputs
        eventually(lambda: answer() is None, "the answer to be freed", timeout=10)
    finally:
        gc.enable()
        worker.stop()
