"""Server settings: one frozen value, from flags or ``EAGLE3_TARGET_*`` variables, passed down."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Annotated

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from eagle3_target.engines import DEFAULT_ENGINE, ENGINES
from eagle3_target.protocol import MAX_CAPTURE_LAYERS

ENV_PREFIX = "EAGLE3_TARGET_"
# Input tensors are int64 [B,S]: ids plus attention and loss masks, and headroom for safetensors headers.
_BODY_BYTES_PER_TOKEN = 3 * 8
_BODY_SLACK_BYTES = 64 * 1024
DEFAULT_MAX_RESPONSE_BYTES = 4 * 2**30
# Room for four of the largest answers at once, when the container has no memory limit.
DEFAULT_MAX_RESPONSE_BYTES_IN_FLIGHT = 4 * DEFAULT_MAX_RESPONSE_BYTES
# cgroup v2, then v1 (which reports "no limit" as a huge number).
_CGROUP_MEMORY_LIMITS = (
    ("/sys/fs/cgroup/memory.max", 2**62),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", 2**62),
)


def _words(value: object) -> object:
    """An environment variable holding several values separates them with spaces, as the shell does."""
    return value.split() if isinstance(value, str) else value


class ServerSettings(BaseSettings):
    """Every server setting, declared once. `eagle3-target serve` derives one flag per field from this class
    (see `cli.py`); each field also reads ``EAGLE3_TARGET_<FIELD>``; flags win over the environment."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, frozen=True, extra="forbid", protected_namespaces=()
    )

    model: str = Field(description="Local model directory (required).")
    engine: str = Field(DEFAULT_ENGINE, description=f"The engine: {' or '.join(ENGINES)}.")
    dtype: str = Field("auto", description="Model dtype: auto, bfloat16, float32...")
    aux_layer_ids: Annotated[tuple[int, int, int] | None, NoDecode] = Field(
        None, description="Three HF aux layer ids (default: [1, L//2-1, L-4])."
    )
    capture_layer_ids: Annotated[tuple[int, ...] | None, NoDecode] = Field(
        None,
        description=f"HF layer ids to capture, comma-separated (1 to {MAX_CAPTURE_LAYERS}; L-1 is the last "
        "hidden state before the final norm), for the `layers` format; must include the aux layers; default: "
        "the aux layers.",
    )
    tensor_parallel_size: int = Field(1, description="GPUs per replica (sharded engines: vllm, sglang).")
    max_model_len: int | None = Field(
        None, description="Longest accepted sequence (default: the model config's max_position_embeddings)."
    )
    engine_args: Annotated[dict[str, object], NoDecode] = Field(
        default_factory=dict,
        description="Extra engine argument KEY=VALUE (repeatable; the variable holds them space-separated).",
        json_schema_extra={"flag": "engine-arg"},
    )
    host: str = Field("0.0.0.0", description="Address to listen on.")
    port: int = Field(8000, description="Port of the API, the probes and /metrics.")
    metrics_port: int = Field(
        0,
        description="Also serve /metrics alone on this port (0: off), for a network policy to open alone.",
    )
    max_batch_tokens: int = Field(32768, description="Most tokens per request and per engine batch.")
    max_queue: int = Field(64, description="Requests that may wait for the engine; more get 429.")
    max_response_bytes: int | None = Field(
        None,
        description="Largest answer one request may get, in bytes; bigger ones get 413 before any compute "
        "(default: a quarter of the container's memory limit, at most 4 GiB).",
    )
    max_response_bytes_in_flight: int | None = Field(
        None,
        description="Bytes that all answers being computed or sent may hold at once; a request whose answer "
        "would pass it gets 503 with Retry-After, unless no other answer is held (default: half the "
        "container's memory limit, at most 16 GiB).",
    )
    max_vocab_mappings: int = Field(64, description="Draft vocabularies kept; the least recently used goes.")
    request_header_timeout: float = Field(
        10.0, gt=0, description="Seconds a connection has to send a request's headers, else it is closed."
    )
    request_body_timeout: float = Field(
        60.0, gt=0, description="Seconds a request's body has to arrive after its headers, else it is closed."
    )
    # Longer than TCP's retransmission back-off through a ~25 s network outage and any pause of a live
    # client; short enough that a frozen or vanished reader lets go of its answer within half a minute.
    response_send_timeout: float = Field(
        30.0,
        gt=0,
        description="Seconds an answer may go without the client taking any of its bytes; then the "
        "connection is closed and the answer freed.",
    )
    max_connections: int = Field(
        1024,
        ge=1,
        description="Connections served at once (lowered to fit the open-file limit); beyond them a few more "
        "may ask /healthz, /readyz and /metrics, and the rest get 503.",
    )
    auth_token_file: Path | None = Field(
        None,
        description="Require the bearer token in this file on the data routes (default: none, all open); "
        "read again within a second of a change, so a rotated Secret needs no restart (the previous token "
        "stays accepted for 3 minutes).",
    )
    trust_remote_code: bool = Field(False, description="Let transformers run the model repository's code.")
    model_name: str | None = Field(None, description="Name in /v1/info (default: the --model path).")
    revision: str | None = Field(None, description="Revision in /v1/info (default: none).")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR.")
    # The path Kubernetes reads (terminationMessagePath).
    termination_log: Path = Field(
        Path("/dev/termination-log"),
        description="Where a failed start writes its one-line reason, if the file exists "
        "(Kubernetes makes it).",
    )

    @field_validator("aux_layer_ids", mode="before")
    @classmethod
    def _aux_layer_ids(cls, value: object) -> object:
        value = _words(value)
        if isinstance(value, list | tuple) and len(value) != 3:
            raise ValueError(f"exactly 3 aux layer ids are needed, got {list(value)}")
        return value

    @field_validator("capture_layer_ids", mode="before")
    @classmethod
    def _capture_layer_ids(cls, value: object) -> object:
        """Commas or spaces between the ids; their rules need the model's depth (`contract.capture_plan`,
        checked at start before the model loads)."""
        return value.replace(",", " ").split() if isinstance(value, str) else value

    @field_validator("engine_args", mode="before")
    @classmethod
    def _engine_args(cls, value: object) -> object:
        value = _words(value)
        return parse_engine_args(value) if isinstance(value, list | tuple) else value

    @field_validator("engine")
    @classmethod
    def _engine(cls, value: str) -> str:
        if value not in ENGINES:
            raise ValueError(f"engine must be one of {tuple(ENGINES)}, got {value!r}")
        return value

    @field_validator(
        "tensor_parallel_size",
        "max_batch_tokens",
        "max_queue",
        "max_vocab_mappings",
        "max_model_len",
        "max_response_bytes",
        "max_response_bytes_in_flight",
    )
    @classmethod
    def _positive(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"{info.field_name} must be at least 1, got {value}")
        return value

    @model_validator(mode="after")
    def _metrics_port_of_its_own(self) -> ServerSettings:
        if self.metrics_port == self.port:
            raise ValueError(f"metrics_port must differ from port ({self.port})")
        return self

    @property
    def display_name(self) -> str:
        """The model name reported in /v1/info: ``--model-name``, else the model path as given."""
        return self.model_name or self.model

    @property
    def token_body_limit(self) -> int:
        """Largest accepted body for routes that take token batches."""
        return _BODY_BYTES_PER_TOKEN * self.max_batch_tokens + _BODY_SLACK_BYTES

    # Both cached: the container's memory limit is read once, so /v1/info's max_response_bytes and what
    # AnswerMemory enforces are the same values.
    @cached_property
    def response_byte_limit(self) -> int:
        """``--max-response-bytes``, else what fits the container: the answer is held in host memory (up to
        1.5 times, while it streams) beside the model, the queue and the other clients' answers."""
        return _memory_share(self.max_response_bytes, DEFAULT_MAX_RESPONSE_BYTES, divisor=4)

    @cached_property
    def in_flight_byte_limit(self) -> int:
        """``--max-response-bytes-in-flight``, else half the container's memory: two of the largest answers
        by default, beside the model, the queue and the transport's buffers."""
        return _memory_share(
            self.max_response_bytes_in_flight, DEFAULT_MAX_RESPONSE_BYTES_IN_FLIGHT, divisor=2
        )


def _memory_share(flag: int | None, default: int, *, divisor: int) -> int:
    """A memory limit's flag when set, else ``default`` or ``1/divisor`` of the container's memory limit,
    whichever is less."""
    if flag is not None:
        return flag
    memory = container_memory_limit()
    return default if memory is None else min(default, memory // divisor)


def container_memory_limit() -> int | None:
    """The cgroup's memory limit in bytes (v2, else v1), or None when unlimited or unknown."""
    for path, unlimited in _CGROUP_MEMORY_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text == "max" or not text.isdigit() or int(text) >= unlimited:
            return None
        return int(text)
    return None


def describe(error: ValidationError) -> str:
    """A refused setting in one line (for the termination log): each problem's own message, `; `-joined."""
    return "; ".join(
        str(problem["ctx"]["error"])
        if problem["type"] == "value_error"
        else f"{'.'.join(str(part) for part in problem['loc'])}: {problem['msg']}"
        for problem in error.errors()
    )


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


def parse_engine_args(items: list[str] | tuple[str, ...]) -> dict[str, object]:
    return dict(parse_engine_arg(item) for item in items)
