"""Server settings: one frozen value built by the CLI (flags or ``EAGLE3_TARGET_*`` env) and passed down."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_target.engines import DEFAULT_ENGINE, ENGINES

# Input tensors are int64 [B,S]: ids plus attention and loss masks, and headroom for safetensors headers.
_BODY_BYTES_PER_TOKEN = 3 * 8
_BODY_SLACK_BYTES = 64 * 1024


@dataclass(frozen=True)
class ServerSettings:
    model: str
    engine: str = DEFAULT_ENGINE
    dtype: str = "auto"
    aux_layer_ids: tuple[int, ...] | None = None
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    engine_args: dict[str, object] = field(default_factory=dict)
    host: str = "0.0.0.0"
    port: int = 8000
    max_batch_tokens: int = 32768
    max_queue: int = 64
    auth_token_file: Path | None = None
    trust_remote_code: bool = False
    model_name: str | None = None
    revision: str | None = None
    max_vocab_mappings: int = 64
    # Where a failed start writes its one-line reason: the path Kubernetes reads (terminationMessagePath).
    termination_log: Path = Path("/dev/termination-log")

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {tuple(ENGINES)}, got {self.engine!r}")
        for name in ("tensor_parallel_size", "max_batch_tokens", "max_queue", "max_vocab_mappings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != 3:
            raise ValueError(f"exactly 3 aux layer ids are needed, got {list(self.aux_layer_ids)}")

    @property
    def display_name(self) -> str:
        """The model name reported in /v1/info: ``--model-name``, else the model path as given."""
        return self.model_name or self.model

    @property
    def token_body_limit(self) -> int:
        """Largest accepted body for routes that take token batches."""
        return _BODY_BYTES_PER_TOKEN * self.max_batch_tokens + _BODY_SLACK_BYTES


def mapping_body_limit(vocab_size: int) -> int:
    """Largest accepted vocab-mapping body: int64 ids and a bool mask over the whole target vocab."""
    return 9 * vocab_size + _BODY_SLACK_BYTES


_PYTHON_LITERALS = {"True": True, "False": False, "None": None}


def parse_engine_arg(item: str) -> tuple[str, object]:
    """``KEY=VALUE`` with VALUE read as JSON when it parses (numbers, booleans, lists), else as a string.

    Python's spellings of booleans and None are accepted too, as YAML-to-CLI renderers often produce them.
    """
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"engine arg must look like KEY=VALUE, got {item!r}")
    if raw in _PYTHON_LITERALS:
        return key.replace("-", "_"), _PYTHON_LITERALS[raw]
    try:
        value: object = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.replace("-", "_"), value


def parse_engine_args(items: list[str]) -> dict[str, object]:
    return dict(parse_engine_arg(item) for item in items)
