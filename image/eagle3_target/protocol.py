"""What crosses the wire or the Kubernetes API, in one place that server, client and operator all import.

Torch-free on purpose: the operator image ships this package without torch, and reads only these names.
The server's computations live in `formats`; this module says what each format is called, which tensors
it carries and which query parameters it takes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

# The Eagle3Target custom resource (crds/eagle3targets.eagle3.dev.yaml).
GROUP = "eagle3.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "Eagle3Target"
PLURAL = "eagle3targets"
# The operator's name wherever the API records who wrote something: server-side apply, events, labels.
FIELD_MANAGER = "eagle3-operator"

OCTET_STREAM = "application/octet-stream"


class TransportName(StrEnum):
    """How supervision leaves the server: an HTTP body (always on), a send over a two-rank process group per
    client (NeMo's NCCL transport; gloo between CPUs), or a put into a Mooncake store the client reads."""

    HTTP = "http"
    NCCL = "nccl"
    MOONCAKE = "mooncake"


class TokenFileError(ValueError):
    """A bearer-token file that cannot be read or holds no token (the message never holds a token)."""


def read_token_file(path: Path) -> str:
    """The bearer token in `path`, surrounding whitespace removed (Secrets mounted as files end with a
    newline). The server checks requests against it and clients send it, so both read it here."""
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise TokenFileError(f"cannot read token file {path}: {reason}") from None
    if not token:
        raise TokenFileError(f"token file {path} is empty")
    return token


# GET /v1/weights/{name}.
WEIGHT_NAMES = ("input_embeddings", "lm_head", "final_norm")
# The `dtype` values /v1/supervision takes for formats that take one; the first is the default.
LOGITS_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Format:
    """One supervision format as the API sees it: its tensors and the query parameters it takes."""

    tensors: tuple[str, ...]
    needs_vocab: bool = False  # computed in a draft vocabulary: `vocab=<mapping id>` is required
    takes_dtype: bool = False  # full-vocab logits whose dtype `dtype=` picks
    # Its last hidden state is h_L *before* the final norm, for trainers that apply the target's norm
    # themselves (speculators); NeMo's trainer batch cannot be rebuilt from it.
    prenorm: bool = False


# The EAGLE-3 formats: the three aux layers and what rebuilds the target's distribution.
FORMATS: dict[str, Format] = {
    "hidden": Format(("aux_hidden_states", "final_hidden")),
    "draft": Format(("aux_hidden_states", "draft_logits", "logsumexp", "argmax"), needs_vocab=True),
    "probs": Format(("aux_hidden_states", "target_probs", "position_mask"), needs_vocab=True),
    "logits": Format(("aux_hidden_states", "logits"), takes_dtype=True),
    "hidden_prenorm": Format(("aux_hidden_states", "final_hidden_prenorm"), prenorm=True),
}

# The most decoder layers one target captures: DFlash-style drafts take 5-6, and each captured layer is a
# full hidden state per token on every answer that asks for it.
MAX_CAPTURE_LAYERS = 32

# The format for any draft method: captured layers chosen per request (`layers=`) and, if asked, the last
# hidden state before or after the final norm (`final=`). `layers=none` asks for the final state alone.
LAYERS_FORMAT = "layers"
LAYERS_TENSOR = "hidden_states"
NO_LAYERS = "none"
# `final=` values and the tensor each ships (none: no final state).
FinalState = Literal["none", "prenorm", "postnorm"]
FINAL_STATES: dict[FinalState, str | None] = {
    "none": None,
    "prenorm": "final_hidden_prenorm",
    "postnorm": "final_hidden",
}
# What /v1/info lists and /v1/supervision's `format=` takes.
SERVED_FORMATS = (*FORMATS, LAYERS_FORMAT)


@dataclass(frozen=True)
class LayerSelection:
    """A `layers` request: which captured layers, in the order wanted (empty for none), and which final
    state. The client builds its query from it, the server parses the query into it."""

    layers: tuple[int, ...]
    final: FinalState = "none"

    def __post_init__(self) -> None:
        if self.final not in FINAL_STATES:
            raise ValueError(f"unknown final state {self.final!r}; expected one of {list(FINAL_STATES)}")
        if len(set(self.layers)) != len(self.layers):
            raise ValueError(f"layers must be distinct, got {list(self.layers)}")
        if not self.layers and self.final == "none":
            raise ValueError(
                "layers=none asks for no tensor: ask for a final state (final=prenorm or postnorm)"
            )

    @property
    def final_tensor(self) -> str | None:
        return FINAL_STATES[self.final]

    @property
    def tensors(self) -> tuple[str, ...]:
        """The tensors of the answer, in order."""
        layers = (LAYERS_TENSOR,) if self.layers else ()
        return layers + ((self.final_tensor,) if self.final_tensor else ())

    def query(self) -> dict[str, str]:
        layers = ",".join(str(i) for i in self.layers) if self.layers else NO_LAYERS
        return {"format": LAYERS_FORMAT, "layers": layers, "final": self.final}

    @classmethod
    def checked(cls, layers: Sequence[int], final: str, captured: Sequence[int]) -> LayerSelection:
        """A selection whose layers the target captures; ValueError names both sets otherwise."""
        uncaptured = [i for i in layers if i not in captured]
        if uncaptured:
            raise ValueError(
                f"layers {uncaptured} are not captured by this target; it captures {list(captured)}"
            )
        return cls(tuple(layers), cast(FinalState, final))  # __post_init__ checks `final`

    @classmethod
    def parse(cls, layers: str | None, final: str | None, captured: Sequence[int]) -> LayerSelection:
        """From the query's `layers` (`parse_layer_ids`; absent: every captured layer, in capture order)
        and `final`; ValueError says what is wrong."""
        wanted = tuple(captured) if layers is None else parse_layer_ids(layers)
        return cls.checked(wanted, final or "none", captured)


def parse_layer_ids(text: str) -> tuple[int, ...]:
    """Layer ids written as a comma-separated list (`1,5,9`), or `none` for no layers."""
    if text.strip() == NO_LAYERS:
        return ()
    try:
        return tuple(int(word) for word in text.split(","))
    except ValueError:
        raise ValueError(
            f"layers must be a comma-separated list of layer ids or {NO_LAYERS!r}, got {text!r}"
        ) from None


class TargetInfo(BaseModel):
    """GET /v1/info: the served model and the limits a client must respect.

    Readers ignore fields they do not know, so a newer server still answers an older client or operator.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str
    revision: str | None = None
    engine: str
    dtype: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    aux_layer_ids: list[int]
    # The layers the `layers` format can ship, in capture order (the aux layers among them); servers older
    # than capture sets captured the aux layers only.
    capture_layer_ids: list[int] | None = None
    fingerprint: str
    formats: list[str]
    max_batch_tokens: int
    # The largest answer one request may get (413 beyond); None from servers older than the limit.
    max_response_bytes: int | None = None
    max_model_len: int
    version: str

    def served_model(self) -> ServedModel:
        return ServedModel(
            name=self.model,
            revision=self.revision,
            dtype=self.dtype,
            engine=self.engine,
            num_hidden_layers=self.num_hidden_layers,
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            aux_layer_ids=self.aux_layer_ids,
            capture_layer_ids=self.captured_layers,
            fingerprint=self.fingerprint,
        )

    @property
    def captured_layers(self) -> list[int]:
        """The capture set (the aux layers for a server that predates capture sets)."""
        return self.capture_layer_ids if self.capture_layer_ids is not None else self.aux_layer_ids


class ServedModel(BaseModel):
    """An Eagle3Target's status.model: the model its ready servers reported at /v1/info, in the resource's
    camelCase. The operator writes it; training jobs read it to check what they resolved."""

    model_config = ConfigDict(extra="ignore", frozen=True, alias_generator=to_camel, populate_by_name=True)

    name: str
    revision: str | None = None
    dtype: str
    engine: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    aux_layer_ids: list[int]
    capture_layer_ids: list[int] | None = None
    fingerprint: str

    def to_status(self) -> dict[str, object]:
        return self.model_dump(mode="json", by_alias=True)


# ---- the server's start-up, as /readyz and the container's exit report it ----------------------------

# How `eagle3-target serve` exits when it cannot serve: 2 for settings it refuses (the CLI's usage error),
# 3 when the model does not load, 4 when the loaded engine died (a worker process gone, the device lost:
# a restart is the cure, so it is not a load failure). Each time its termination message says what.
EXIT_INVALID_SETTINGS = 2
EXIT_LOAD_FAILED = 3
EXIT_ENGINE_FAILED = 4


class LoadPhase(StrEnum):
    STARTING = "starting"
    WAITING_FOR_WEIGHTS = "waiting_for_weights"  # weights still arriving in the model directory
    LOADING = "loading"  # the engine loads the weights (vLLM also compiles and captures CUDA graphs)
    CANARY = "canary"  # the start-up check of the loaded model's outputs
    FAILED = "failed"


class LoadProgress(BaseModel):
    """The `loading` member of a 503 from /readyz (and every route that needs the model) while it loads."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    phase: LoadPhase
    message: str
    done: int | None = None
    total: int | None = None
    elapsed_seconds: float = 0.0


# Who pulls: every client of ours names its process (host or pod, and a per-process id) in this header, so a
# server can tell its consumers apart; a client that sends none (NeMo's) is known by its peer address.
CLIENT_HEADER = "X-Eagle3-Client"
# Set (to the time, or any new value) on an Eagle3Target to wake it from Idle: `resolve()` does when it finds
# a target idle; the operator wakes a target whose value differs from the one it recorded when it went idle.
ANNOTATION_WAKE_REQUESTED = f"{GROUP}/wake-requested-at"
# status.idle's members: when the target went idle, and that annotation's value then.
IDLE_SINCE = "since"
IDLE_WAKE_RECORDED = "wakeRequestedAt"


def wake_annotation(metadata: Mapping[str, Any]) -> str | None:
    """A target's wake annotation (from its metadata), None when unset."""
    return (metadata.get("annotations") or {}).get(ANNOTATION_WAKE_REQUESTED)


def wake_requested(annotation: str | None, idle: Mapping[str, Any]) -> bool:
    """Whether an idle target (`idle`: its status.idle) is asked to wake: its wake annotation now differs
    from the value recorded when it went idle. Comparing values, not times, is immune to clock skew between
    the caller and the operator."""
    return annotation != idle.get(IDLE_WAKE_RECORDED)


# A consumer is active while its last data request is at most this old (the server's active-clients gauge,
# the operator's status.consumers).
CONSUMER_WINDOW_SECONDS = 600


class ClientActivity(BaseModel):
    """One consumer as a server saw it: its id (the header, else `peer HOST`), its data requests, the last."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True)

    id: str
    requests: int
    idle_seconds: float  # since its last data request, on the server's monotonic clock


class Activity(BaseModel):
    """A server's data requests (supervision, NeMo's /generate, weights): what /readyz says besides "ready",
    for the operator to tell an idle target from a used one without credentials.

    Ages, not times: each is measured on the server's own monotonic clock when it answers, so the reader
    places them on its own clock (the moment it got the answer, minus the age) and no clock skew between
    nodes, nor a wall clock set back, can make a request look older than it is. `clients` are the most recent
    ones, at most a few dozen, and only for a caller that may know who trains (any caller without auth, one
    with the token on a target with auth); the counts and ages are for everyone."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True)

    requests: int = 0
    idle_seconds: float | None = None  # since the last start or end of one; None before the first
    in_flight: int = 0  # data requests being handled now (a target serving one is not idle)
    active_clients: int = 0  # clients with a data request in the last CONSUMER_WINDOW_SECONDS
    clients: tuple[ClientActivity, ...] = ()


class HydrationProgress(BaseModel):
    """What a running `eagle3-target hydrate` answers on its progress port; None where not known yet."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True)

    files_done: int | None = None
    files_total: int | None = None
    bytes_done: int | None = None
    bytes_total: int | None = None
