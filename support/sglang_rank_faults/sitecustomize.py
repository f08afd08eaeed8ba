"""With this folder on PYTHONPATH, every process (the spawned ranks included) imports this at start and
replaces SGLang's model runner with the fault-injecting `FaultyRank` of `faults`. Kept apart from `faults`
so that the tests can read its tokens without patching SGLang in their own process."""

from __future__ import annotations

import eagle3_target.runners.sglang_rank as sglang_rank

# A top-level module here (this folder is on sys.path); to the tests, support.sglang_rank_faults.faults.
from faults import FaultyRank  # type: ignore[import-not-found]

sglang_rank.start_model_runner = lambda server_args, tp_rank=0: tp_rank
sglang_rank.RankCapture = FaultyRank  # type: ignore[misc]
