"""The engine's outputs brought to the host off the engine's critical path.

On CUDA each output is copied into pinned host memory with a non-blocking copy on a side stream, after
the kernels that produce it; the engine thread goes on to its next batch at once, and the response waits
for the copy's event on a pool thread (never the event loop) before it streams. Pinned buffers come from
torch's caching host allocator, which keeps freed pinned blocks for reuse, so a steady load pins no new
memory per request. Outputs already on the host (the CPU, vLLM's captured states) pass through untouched.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

_streams: dict[torch.device, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


@dataclass(frozen=True)
class HostOutputs:
    """Outputs on the host once `wait` returns (at once when no copy is in flight)."""

    tensors: dict[str, torch.Tensor]
    copied: torch.cuda.Event | None = None

    @property
    def pending(self) -> bool:
        return self.copied is not None and not self.copied.query()

    def wait(self) -> dict[str, torch.Tensor]:
        if self.copied is not None:
            self.copied.synchronize()
        return self.tensors


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    with _streams_lock:
        if device not in _streams:
            _streams[device] = torch.cuda.Stream(device)
        return _streams[device]


def to_host(outputs: dict[str, torch.Tensor]) -> HostOutputs:
    """Start copying every CUDA output to pinned host memory; returns without waiting for the copies."""
    on_device = [t for t in outputs.values() if t.is_cuda]
    if not on_device:
        return HostOutputs(outputs)
    device = on_device[0].device
    stream = _side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    host: dict[str, torch.Tensor] = {}
    with torch.cuda.stream(stream):
        for name, tensor in outputs.items():
            if not tensor.is_cuda:
                host[name] = tensor
                continue
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            buffer.copy_(tensor, non_blocking=True)
            # The engine may drop `tensor` now: the allocator keeps its memory until the copy is done.
            tensor.record_stream(stream)
            host[name] = buffer
        copied = torch.cuda.Event()
        copied.record(stream)
    return HostOutputs(host, copied)
