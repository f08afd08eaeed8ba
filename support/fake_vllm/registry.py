"""The stand-in's model registry and EAGLE-3 interface (`vllm.model_executor.models.registry` and
`.interfaces` in vLLM 0.33): which architectures vLLM registers, which of their classes implement
`SupportsEagle3`, and `_run_in_subprocess`. Importing a model class marks CUDA initialised in that process
(`CUDA_STATE`), so a test can tell whether the runner inspected it in a child, as vLLM's registry does.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Protocol, TypeVar, runtime_checkable

_T = TypeVar("_T")


@dataclass
class CudaState:
    """Whether this process has initialised CUDA (`torch.cuda.is_initialized()` on a GPU machine)."""

    initialized: bool = False


CUDA_STATE = CudaState()


@runtime_checkable
class SupportsEagle3(Protocol):
    """`SupportsEagle3` (with `SupportsEagleBase`'s members): vLLM checks it with isinstance."""

    has_own_lm_head: bool = False
    has_own_embed_tokens: bool = False
    supports_eagle3: ClassVar[Literal[True]] = True

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None: ...


def supports_eagle3(model: object) -> bool:
    return isinstance(model, SupportsEagle3)


class LlamaForCausalLM(SupportsEagle3):
    """vLLM 0.33's `LlamaForCausalLM` implements SupportsEagle3."""


class Qwen3ForCausalLM(SupportsEagle3):
    """vLLM 0.33's `Qwen3ForCausalLM` implements SupportsEagle3."""


class DeepseekV3ForCausalLM(SupportsEagle3):
    """vLLM 0.33's `DeepseekV3ForCausalLM` implements SupportsEagle3 (and uses MLA attention)."""


class Gemma3ForCausalLM:
    """vLLM 0.33's `Gemma3ForCausalLM` does not implement SupportsEagle3."""


@dataclass(frozen=True)
class RegisteredModel:
    model_cls: type

    def load_model_cls(self) -> type:
        # Importing a vLLM model module may initialise CUDA; vLLM inspects classes in a subprocess for that
        # reason (vLLM 0.33's `_LazyRegisteredModel.inspect_model_cls`).
        CUDA_STATE.initialized = True
        return self.model_cls


@dataclass
class _ModelRegistry:
    models: dict[str, RegisteredModel] = field(
        default_factory=lambda: {
            cls.__name__: RegisteredModel(cls)
            for cls in (LlamaForCausalLM, Qwen3ForCausalLM, DeepseekV3ForCausalLM, Gemma3ForCausalLM)
        }
    )

    def get_supported_archs(self) -> set[str]:
        return set(self.models)


ModelRegistry = _ModelRegistry()


def _run_in_subprocess(fn: Callable[[], _T]) -> _T:
    """The registry's `_run_in_subprocess`: runs `fn` in a child process and returns its pickled result
    (vLLM starts `python -m vllm.model_executor.models.registry`; a fork keeps the stand-in installed)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, send the result, leave without running the parent's exit handlers
        os.close(read_fd)
        try:
            payload = pickle.dumps((True, fn()))
        except BaseException as exc:  # reported to the parent, as vLLM reports the child's stderr
            payload = pickle.dumps((False, repr(exc)))
        with os.fdopen(write_fd, "wb") as out:
            out.write(payload)
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as inp:
        data = inp.read()
    os.waitpid(pid, 0)
    ok, result = pickle.loads(data)
    if not ok:
        raise RuntimeError(f"Error raised in subprocess:\n{result}")
    return result


class _CudaPlatform:
    """`vllm.platforms.current_platform` on a GPU machine, as far as the runner asks."""

    def is_cpu(self) -> bool:
        return False


CUDA_PLATFORM = _CudaPlatform()
