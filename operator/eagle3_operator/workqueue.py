"""One work queue for every target's passes, in the shape of controller-runtime's (client-go's workqueue).

Every trigger, timer and retry goes through it, so there is one place that decides when a pass runs:
- `add(key)` queues a pass now; a key already queued is queued once, and a key added while its pass runs
  gets exactly one follow-up pass after it.
- `add_after(key, delay)` queues it later, keeping only the earliest pending delay per key. A delay never
  ends early on the queue's clock: the pass it starts sees at least `delay` gone (an event loop may fire a
  timer a little early; the queue then waits the rest), so a pass can compare deadlines it took from
  `now()` with no second clock to disagree.
- The pass (`process(key)`) returns when it wants to run again (seconds, or None): level-based, the next
  pass recomputes everything, so a timer that was superseded or is no longer needed costs one cheap pass.
- `backoff(key)` is the key's next retry delay, growing with each failure until `forget(key)`; a pass that
  raises is logged and retried after it.
- At most `concurrency` passes run at once, one per key at a time, in the order keys were queued.
- Until `start()` nothing runs, only queues (a standby fills the queue from its warm indexes and starts it
  when it wins the Lease). `shutdown()` stops in order: no adds from then on, timers cancelled, running
  passes finished (cancelled after a grace period); nothing runs once it returns.
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)
K = TypeVar("K", bound=Hashable)

# Waits before another try after a failure of the same key (the last repeats).
RETRY_DELAYS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
SHUTDOWN_GRACE_SECONDS = 10.0


class WorkQueue(Generic[K]):
    def __init__(
        self,
        process: Callable[[K], Awaitable[float | None]],
        *,
        concurrency: int,
        delays: Sequence[float] = RETRY_DELAYS,
        expected_errors: tuple[type[Exception], ...] = (),
        name: str = "pass",
    ) -> None:
        """`expected_errors` are logged in one line when a pass raises them; anything else with its traceback.
        `name` says what a pass is in log lines and task names."""
        self._process = process
        self._concurrency = concurrency
        self._delays = tuple(delays)
        self._expected = expected_errors
        self._name = name
        self._ready: asyncio.Queue[K] = asyncio.Queue()
        self._queued: set[K] = set()  # in _ready, or added while running (queued again when it ends)
        self._running: set[K] = set()
        self._timers: dict[K, tuple[float, asyncio.TimerHandle]] = {}  # key -> (due on now(), its timer)
        self._failures: dict[K, int] = {}
        self._workers: dict[asyncio.Task[None], K | None] = {}  # worker -> the key it processes
        self._shut = False

    @staticmethod
    def now() -> float:
        """The queue's clock (monotonic seconds): deadlines a pass compares against its delays."""
        return time.monotonic()

    def __len__(self) -> int:
        """Keys waiting for a pass now (not counting those waiting for a delay)."""
        return self._ready.qsize()

    def add(self, key: K) -> None:
        if self._shut or key in self._queued:
            return
        self._queued.add(key)
        if key not in self._running:
            self._ready.put_nowait(key)

    def add_after(self, key: K, delay: float) -> None:
        if self._shut:
            return
        if delay <= 0:
            self.add(key)
            return
        due = self.now() + delay
        pending = self._timers.get(key)
        if pending is not None:
            if pending[0] <= due:
                return
            pending[1].cancel()
        self._arm(key, due)

    def backoff(self, key: K) -> float:
        """The delay before this key's next retry; each call counts one more failure."""
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        return self._delays[min(failures, len(self._delays) - 1)]

    def forget(self, key: K) -> None:
        """The key succeeded: its next failure waits the first delay again."""
        self._failures.pop(key, None)

    def start(self) -> None:
        if self._workers or self._shut:
            return
        for number in range(self._concurrency):
            task = asyncio.create_task(self._work(), name=f"{self._name} worker {number}")
            self._workers[task] = None

    async def shutdown(self, grace: float = SHUTDOWN_GRACE_SECONDS) -> None:
        self._shut = True
        for _, timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for worker, key in self._workers.items():
            if key is None:
                worker.cancel()  # idle: waiting for a key that will never come
        if self._workers:
            _, late = await asyncio.wait(self._workers, timeout=grace)
            for worker in late:
                worker.cancel()
            await asyncio.wait(self._workers)
        self._workers.clear()

    def _arm(self, key: K, due: float) -> None:
        delay = max(due - self.now(), 0.0)
        self._timers[key] = (due, asyncio.get_running_loop().call_later(delay, self._due, key, due))

    def _due(self, key: K, due: float) -> None:
        if self.now() < due:  # fired early by the loop's clock: wait out the rest
            self._arm(key, due)
            return
        del self._timers[key]
        self.add(key)

    async def _work(self) -> None:
        me = asyncio.current_task()
        assert me is not None
        while not self._shut:
            key = await self._ready.get()
            self._workers[me] = key
            self._queued.discard(key)
            self._running.add(key)
            try:
                again = await self._process(key)
            except asyncio.CancelledError as error:
                if me.cancelling():  # shutdown cancelled this worker
                    raise
                again = self._failed(key, error)  # a pass cancelled by something of its own
            except Exception as error:  # the queue's boundary: a failed pass is retried, never lost
                again = self._failed(key, error)
            finally:
                self._running.discard(key)
                self._workers[me] = None
                if key in self._queued:
                    self._ready.put_nowait(key)
            if again is not None:
                self.add_after(key, again)

    def _failed(self, key: K, error: BaseException) -> float:
        """Log a failed pass; the delay before it is retried."""
        delay = self.backoff(key)
        log = logger.warning if isinstance(error, self._expected) else logger.exception
        log("%s of %s failed, retrying in %.0fs: %s", self._name, _describe(key), delay, error)
        return delay


def _describe(key: Hashable) -> str:
    """A key as log lines show it: a (namespace, name) key reads namespace/name."""
    if isinstance(key, tuple):
        return "/".join(str(part) for part in key)
    return str(key)
