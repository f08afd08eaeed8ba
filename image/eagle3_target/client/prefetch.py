"""Overlap fetching the next batches with the trainer's step, yielding results in submission order."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


def prefetch(
    fn: Callable[[Item], Result], items: Iterable[Item], depth: int = 2
) -> Generator[Result, None, None]:
    """Yield `fn(item)` for each item, in order, keeping up to `depth` calls running ahead of the consumer.

    An exception from `fn` is raised when its result would have been yielded; calls still running are
    cancelled or awaited before this generator returns, so no request outlives the loop that started it.
    """
    if depth < 1:
        raise ValueError(f"prefetch depth must be >= 1, got {depth}")
    iterator = iter(items)
    pending: deque[Future[Result]] = deque()
    with ThreadPoolExecutor(max_workers=depth, thread_name_prefix="eagle3-prefetch") as pool:
        try:
            for item in iterator:
                pending.append(pool.submit(fn, item))
                if len(pending) >= depth:
                    break
            while pending:
                result = pending.popleft().result()
                for item in iterator:
                    pending.append(pool.submit(fn, item))
                    break
                yield result
        finally:
            for future in pending:
                future.cancel()
