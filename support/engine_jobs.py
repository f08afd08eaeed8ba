"""Engine jobs for the tests of the engine worker and of what waits on it: one that holds the engine thread
until released, so the jobs submitted meanwhile queue (fault injection: a batch that takes its time)."""

from __future__ import annotations

import threading

import torch
from eagle3_target.server.batching import EngineJob, Tensors


def double(inputs: Tensors) -> Tensors:
    return {"doubled": inputs["input_ids"] * 2, "row_sum": inputs["input_ids"].sum(dim=1)}


class Blocker:
    """A one-token job that holds the engine thread until released, so the jobs submitted meanwhile queue."""

    def __init__(self) -> None:
        self.running, self.release = threading.Event(), threading.Event()
        self.job = EngineJob(
            batch_key="block", inputs={"input_ids": torch.zeros(1, 1, dtype=torch.int64)}, compute=self._hold
        )

    def _hold(self, inputs: Tensors) -> Tensors:
        self.running.set()
        self.release.wait(timeout=30)
        return double(inputs)
