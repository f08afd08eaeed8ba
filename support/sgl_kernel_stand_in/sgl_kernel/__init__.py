"""A stand-in for `sgl_kernel`, installed by `make setup` only into SGLang's environment (`.venv-sglang`).

PyPI has no CPU build of SGLang's kernel package, yet SGLang 0.5.23's CPU mode (`SGLANG_USE_CPU_ENGINE=1`)
imports these eight names when its memory-cache modules load. An extend (prefill) forward calls none of
them, so each one here raises: a forward that ever reached one would fail instead of computing something
else. No `torch.ops` are registered, so SGLang finds no AMX kernels and takes its `forward_native` paths.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

STAND_IN = True

NAMES = (
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "fill_bonus_tokens_cpu",
    "fill_accept_out_cache_loc_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
)


class StandInCalled(RuntimeError):
    """An SGLang code path called a CPU kernel that this stand-in does not have."""


def _refusing(name: str) -> Callable[..., NoReturn]:
    def kernel(*_args: object, **_kwargs: object) -> NoReturn:
        raise StandInCalled(
            f"sgl_kernel.{name} was called, but this sgl_kernel is the import-only stand-in of the CPU "
            "tests (support/sgl_kernel_stand_in): install SGLang's real kernels to run this path"
        )

    kernel.__name__ = name
    return kernel


for _name in NAMES:
    globals()[_name] = _refusing(_name)
