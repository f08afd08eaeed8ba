"""The engine worker: one thread owns the engine; requests wait in a bounded queue and may share a batch.

Runners are not re-entrant (HF capture hooks, vLLM's engine), so exactly one thread calls them. The event
loop only enqueues and awaits. A job is coalesced with later queued jobs that have the same ``batch_key``
(same computation: kind, format, dtype, vocab mapping) and the same sequence length, up to
``max_batch_tokens``; the combined output is split back by rows, so each request gets only its own rows,
and each request's rows start their way to the host (`staging`) before the next batch runs. A job whose
future is cancelled (its client left) is dropped from the queue and never run.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from eagle3_target.server.metrics import ServerMetrics
from eagle3_target.server.staging import to_host

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]


class QueueFull(Exception):
    """The engine has `max_queue` jobs waiting already; the caller should come back shortly."""


@dataclass(eq=False)
class EngineJob:
    """One request's engine work: ``compute`` maps [B,S] inputs to outputs whose dim 0 is B, on any device;
    the future resolves to them as `staging.HostOutputs`."""

    batch_key: Hashable
    inputs: Tensors
    compute: Callable[[Tensors], Tensors]
    future: Future = field(default_factory=Future)

    @property
    def rows(self) -> int:
        return int(self.inputs["input_ids"].shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.inputs["input_ids"].shape[1])

    @property
    def tokens(self) -> int:
        return self.rows * self.seq_len


def run_coalesced(jobs: list[EngineJob]) -> list[Tensors]:
    """Run jobs of one key and length as one engine call and split the outputs back per job."""
    if len(jobs) == 1:
        return [jobs[0].compute(jobs[0].inputs)]
    merged = {name: torch.cat([job.inputs[name] for job in jobs]) for name in jobs[0].inputs}
    outputs = jobs[0].compute(merged)
    sizes = [job.rows for job in jobs]
    pieces = {name: tensor.split(sizes) for name, tensor in outputs.items()}
    return [{name: parts[i] for name, parts in pieces.items()} for i in range(len(jobs))]


class EngineWorker:
    """A single engine thread fed by a bounded FIFO queue."""

    def __init__(self, *, max_queue: int, max_batch_tokens: int, metrics: ServerMetrics) -> None:
        self.max_queue = max_queue
        self.max_batch_tokens = max_batch_tokens
        self.metrics = metrics
        self._queue: deque[EngineJob | None] = deque()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="eagle3-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Finish the batch in progress, fail the queued jobs, and end the thread."""
        with self._cond:
            pending = [job for job in self._queue if job is not None]
            self._queue.clear()
            self._queue.append(None)
            self._cond.notify()
        for job in pending:  # a request that was cancelled while it waited has no one left to tell
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(RuntimeError("server shutting down"))
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def submit(self, job: EngineJob) -> Future:
        """Queue ``job``; `QueueFull` when ``max_queue`` jobs are already waiting."""
        with self._cond:
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"engine queue is full ({self.max_queue} requests waiting)")
            self._queue.append(job)
            self.metrics.queue_depth.set(len(self._queue))
            self._cond.notify()
        job.future.add_done_callback(self._withdraw)
        return job.future

    def _withdraw(self, future: Future) -> None:
        """A job cancelled while it waited (its client left) leaves the queue at once: it is never run and
        holds no place that a live request could have. (Found by its future: a callback holding the job
        would make a reference cycle that keeps every answer alive until the garbage collector runs.)"""
        if not future.cancelled():
            return
        with self._cond:
            for job in self._queue:
                if job is not None and job.future is future:
                    self._queue.remove(job)
                    self.metrics.queue_depth.set(len(self._queue))
                    return

    def _take_batch(self) -> list[EngineJob] | None:
        """The oldest job plus every later compatible job that fits; None means stop."""
        with self._cond:
            while not self._queue:
                self._cond.wait()
            first = self._queue.popleft()
            if first is None:
                return None
            batch, tokens = [first], first.tokens
            for job in list(self._queue):
                if job is None:
                    break
                compatible = job.batch_key == first.batch_key and job.seq_len == first.seq_len
                if compatible and tokens + job.tokens <= self.max_batch_tokens:
                    self._queue.remove(job)
                    batch.append(job)
                    tokens += job.tokens
            self.metrics.queue_depth.set(len(self._queue))
            return batch

    def _loop(self) -> None:
        while (batch := self._take_batch()) is not None:
            live = [job for job in batch if job.future.set_running_or_notify_cancel()]
            if live:
                self.metrics.batch_tokens.observe(sum(job.tokens for job in live))
                self._run(live)
            # Their futures hold the outputs, which must go with their responses (an aborted answer frees
            # its memory at once), not wait here for the next batch.
            del batch, live

    def _run(self, jobs: list[EngineJob]) -> None:
        """Run one batch and resolve its futures; a failed shared batch is retried one job at a time, so
        one request's bad input never fails the requests it was coalesced with."""
        try:
            with torch.inference_mode():
                results = run_coalesced(jobs)
        except Exception as exc:  # the failure belongs to these requests, never to the worker
            if len(jobs) > 1:
                for job in jobs:
                    self._run([job])
                return
            log.warning("engine refused a request: %s: %s", type(exc).__name__, exc)
            jobs[0].future.set_exception(exc)
            return
        for job, result in zip(jobs, results, strict=True):
            job.future.set_result(to_host(result))
