"""The work queue every pass goes through: coalescing, one pass per key at a time, the earliest delay per
key and never an early one, backoff until forgotten, a bounded number of passes at once, nothing before
`start()`, and a shutdown after which nothing runs."""

import asyncio
import logging
import time

import pytest
from eagle3_operator.workqueue import WorkQueue


class Recorder:
    """A pass that records when it ran (on the queue's clock) and can be held open or made to fail."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, float]] = []
        self.running = 0
        self.most_at_once = 0
        self.hold = asyncio.Event()
        self.hold.set()
        self.again: dict[str, float | None] = {}
        self.fail: set[str] = set()

    async def __call__(self, key: str) -> float | None:
        self.runs.append((key, WorkQueue.now()))
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            await self.hold.wait()
            if key in self.fail:
                raise ValueError(f"{key} failed")
            return self.again.pop(key, None)
        finally:
            self.running -= 1

    def keys(self) -> list[str]:
        return [key for key, _ in self.runs]


async def settle(seconds: float = 0.05) -> None:
    await asyncio.sleep(seconds)


async def runs(process: Recorder, count: int, timeout: float = 10.0) -> None:
    """Wait until `count` passes have started (a loaded machine may be slow; never fast)."""
    deadline = time.monotonic() + timeout
    while len(process.runs) < count:
        assert time.monotonic() < deadline, process.runs
        await asyncio.sleep(0.01)


def test_nothing_runs_before_start_and_repeated_adds_make_one_pass():
    async def scenario() -> None:
        process = Recorder()
        queue: WorkQueue[str] = WorkQueue(process, concurrency=4)
        for _ in range(5):
            queue.add("a")
        queue.add("b")
        await settle()
        assert process.runs == [] and len(queue) == 2
        queue.start()
        await settle()
        assert process.keys() == ["a", "b"]
        await queue.shutdown()

    asyncio.run(scenario())


def test_a_key_added_while_its_pass_runs_gets_exactly_one_more_pass_after_it():
    async def scenario() -> None:
        process = Recorder()
        queue: WorkQueue[str] = WorkQueue(process, concurrency=4)
        queue.start()
        process.hold.clear()
        queue.add("a")
        await settle()
        for _ in range(3):
            queue.add("a")
        await settle()
        assert process.keys() == ["a"] and process.most_at_once == 1  # never two passes of one key at once
        process.hold.set()
        await settle()
        assert process.keys() == ["a", "a"]
        await queue.shutdown()

    asyncio.run(scenario())


def test_the_earliest_delay_per_key_wins_and_a_later_one_adds_nothing():
    async def scenario() -> None:
        process = Recorder()
        queue: WorkQueue[str] = WorkQueue(process, concurrency=4)
        queue.start()
        asked = WorkQueue.now()
        queue.add_after("a", 0.6)
        queue.add_after("a", 0.1)  # earlier: replaces the 0.6
        queue.add_after("a", 0.3)  # later than the pending 0.1: nothing
        await runs(process, 1)
        assert process.runs[0][1] - asked >= 0.1
        await settle(0.8)  # past both later delays: neither armed a timer
        assert process.keys() == ["a"]
        await queue.shutdown()

    asyncio.run(scenario())


def test_a_delay_never_ends_early_on_the_queues_clock(monkeypatch: pytest.MonkeyPatch):
    """The loop's timers may fire before the queue's clock says the delay is over (here its clock runs at
    half speed): the pass still starts only once the delay has passed on the queue's clock."""

    async def scenario() -> None:
        start = time.monotonic()
        monkeypatch.setattr(WorkQueue, "now", staticmethod(lambda: start + (time.monotonic() - start) / 2))
        process = Recorder()
        queue: WorkQueue[str] = WorkQueue(process, concurrency=1)
        queue.start()
        asked = WorkQueue.now()
        queue.add_after("a", 0.4)
        await settle(0.5)
        assert process.runs == []  # the loop's 0.4 s timer fired; the queue's clock said 0.25 s
        await runs(process, 1)
        assert process.keys() == ["a"] and process.runs[0][1] - asked >= 0.4
        await queue.shutdown()

    asyncio.run(scenario())


def test_a_pass_asks_when_to_run_again():
    async def scenario() -> None:
        process = Recorder()
        process.again["a"] = 0.05
        queue: WorkQueue[str] = WorkQueue(process, concurrency=1)
        queue.start()
        queue.add("a")
        await runs(process, 2)
        await settle(0.2)
        assert process.keys() == ["a", "a"]  # the second pass asked for nothing more
        await queue.shutdown()

    asyncio.run(scenario())


def test_a_failed_pass_is_logged_and_retried_after_a_growing_backoff_until_forgotten(
    caplog: pytest.LogCaptureFixture,
):
    async def scenario() -> None:
        process = Recorder()
        process.fail.add("a")
        queue: WorkQueue[str] = WorkQueue(
            process, concurrency=1, delays=(0.1, 1.0), expected_errors=(ValueError,), name="check"
        )
        queue.start()
        with caplog.at_level(logging.WARNING, logger="eagle3_operator.workqueue"):
            queue.add("a")
            await runs(process, 2)
            process.fail.clear()
            await runs(process, 3)
        (_, first), (_, second), (_, third) = process.runs
        assert second - first >= 0.1 and third - second >= 1.0  # the backoff grew
        assert "check of a failed, retrying in 0s: a failed" in caplog.text
        assert "check of a failed, retrying in 1s: a failed" in caplog.text
        assert "Traceback" not in caplog.text  # an expected error is one line
        assert queue.backoff("a") == 1.0  # not forgotten: the pass itself decides when a key succeeded
        queue.forget("a")
        assert queue.backoff("a") == 0.1
        await queue.shutdown()

    asyncio.run(scenario())


def test_an_unexpected_error_is_logged_with_its_traceback_and_the_worker_lives_on(
    caplog: pytest.LogCaptureFixture,
):
    async def scenario() -> None:
        process = Recorder()
        process.fail.add("a")
        queue: WorkQueue[str] = WorkQueue(process, concurrency=1, delays=(10.0,))
        queue.start()
        with caplog.at_level(logging.WARNING, logger="eagle3_operator.workqueue"):
            queue.add("a")
            await settle()
        assert "Traceback" in caplog.text and "ValueError: a failed" in caplog.text
        queue.add("b")
        await settle()
        assert process.keys() == ["a", "b"]  # the one worker survived the failure
        await queue.shutdown()

    asyncio.run(scenario())


def test_at_most_concurrency_passes_run_at_once_in_the_order_keys_came():
    async def scenario() -> None:
        process = Recorder()
        process.hold.clear()
        queue: WorkQueue[str] = WorkQueue(process, concurrency=3)
        queue.start()
        for key in "abcdefg":
            queue.add(key)
        await settle()
        assert process.running == 3 and process.keys() == ["a", "b", "c"]
        process.hold.set()
        await settle()
        assert process.keys() == list("abcdefg") and process.most_at_once == 3
        await queue.shutdown()

    asyncio.run(scenario())


def test_shutdown_finishes_running_passes_and_then_nothing_runs():
    async def scenario() -> None:
        process = Recorder()
        queue: WorkQueue[str] = WorkQueue(process, concurrency=2)
        queue.start()
        process.hold.clear()
        queue.add("a")
        queue.add_after("b", 0.1)
        await settle()
        stopping = asyncio.create_task(queue.shutdown(grace=5))
        await settle()
        assert not stopping.done()  # waits for the running pass
        queue.add("c")  # ignored from now on
        process.hold.set()
        await stopping
        await settle(0.2)
        assert process.keys() == ["a"]  # b's timer was cancelled, c never queued

    asyncio.run(scenario())


def test_shutdown_cancels_a_pass_that_outlives_its_grace():
    async def scenario() -> None:
        process = Recorder()
        queue: WorkQueue[str] = WorkQueue(process, concurrency=1)
        queue.start()
        process.hold.clear()
        queue.add("a")
        await settle()
        started = time.monotonic()
        await queue.shutdown(grace=0.1)
        assert time.monotonic() - started < 1 and process.running == 0

    asyncio.run(scenario())
