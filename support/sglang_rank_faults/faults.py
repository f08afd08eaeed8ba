"""The fault-injecting stand-in for SGLang's model runner on a tensor-parallel rank: `FaultyRank`, whose
forwards fail the way SGLang's can, chosen by a token of the batch. Only for what a real engine cannot be
made to do on demand: a lost device, one rank failing alone. Importing it changes nothing (the tests read
its tokens and pool); this folder's sitecustomize puts it in place. See
tests/eagle3_target/runners/test_sglang_tp.py.
"""

from __future__ import annotations

import time

import torch
from eagle3_target.runners.sglang_rank import KVPool

# A batch holding one of these tokens fails: on every rank, as SGLang refuses a batch ("Prefill out of
# memory", rank 0 last); on every rank with a CUDA error, which loses the device; or on rank 1 only, while
# rank 0 waits for it in a collective, for good.
REFUSED_BY_EVERY_RANK = 201
DEVICE_LOST = 202
FAILED_BY_RANK_1 = 203
HIDDEN = 4
POOL = KVPool(tokens=64, rows=8, page=1)


class FaultyRank:
    """`sglang_rank.RankCapture` over no model: a forward gives zeros of the right shapes, or its fault."""

    dtype = torch.float32
    context_len = 32
    pool = POOL
    failure = None

    def __init__(self, tp_rank: int) -> None:
        self.tp_rank = tp_rank

    def placement(self) -> tuple[int, int, int, list[int]]:
        return self.tp_rank, 2, 1, []

    def set_layers(self, layers: list[int]) -> None:
        pass

    def extend(self, prompts: list[list[int]], prenorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = {token for prompt in prompts for token in prompt}
        if REFUSED_BY_EVERY_RANK in tokens:
            if self.tp_rank == 0:
                time.sleep(0.5)  # rank 1's refusal arrives first: the runner still names rank 0's
            raise RuntimeError("Prefill out of memory. Try to lower your batch size.")
        if DEVICE_LOST in tokens:
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        if FAILED_BY_RANK_1 in tokens:
            if self.tp_rank == 1:
                raise RuntimeError("CUDA out of memory on rank 1 only")
            while True:  # an all-reduce that rank 1 never joins
                time.sleep(1)
        n = sum(len(prompt) for prompt in prompts)
        return torch.full((n, HIDDEN), float(self.tp_rank)), torch.zeros(n, 3 * HIDDEN)

    def close(self) -> None:
        pass
