"""The `eagle3-target serve` command line a spec asks for, and the part of it that decides which model a pod
serves (status compares pods by it)."""

from collections.abc import Sequence

from eagle3_target.engines import ENGINES

from eagle3_operator.constants import AUTH_MOUNT
from eagle3_operator.render.model_source import hf_revision, model_path
from eagle3_operator.spec import Eagle3TargetSpec


def server_args(spec: Eagle3TargetSpec) -> list[str]:
    """The `eagle3-target serve` command line the spec asks for."""
    model = spec.managed_model
    args = ["eagle3-target", "serve", "--model", model_path(spec), "--engine", spec.engine]
    args += ["--host", "0.0.0.0", "--port", str(spec.port), "--model-name", model.name]
    args += ["--metrics-port", str(spec.monitoring.metrics_port)]
    revision = hf_revision(spec) if spec.source.hugging_face is not None else model.revision
    if revision is not None:
        args += ["--revision", revision]
    if model.dtype is not None:
        args += ["--dtype", model.dtype]
    if spec.aux_layer_ids is not None:
        args += ["--aux-layer-ids", *(str(layer) for layer in spec.aux_layer_ids)]
    if spec.capture_layer_ids is not None:  # one word: the server's flag takes a comma-separated list
        args += ["--capture-layer-ids", ",".join(str(layer) for layer in spec.capture_layer_ids)]
    if ENGINES[spec.engine].sharded:
        args += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.max_model_len is not None:
        args += ["--max-model-len", str(spec.max_model_len)]
    for key, value in sorted(spec.engine_args.items()):
        args += ["--engine-arg", f"{key}={value}"]
    if spec.auth is not None:
        args += ["--auth-token-file", f"{AUTH_MOUNT}/{spec.auth.token_secret_ref.key}"]
    if model.trust_remote_code:
        args.append("--trust-remote-code")
    return args


# The server flags that decide which model a pod serves, and so its /v1/info fingerprint; the others only
# tune how it is served.
MODEL_IDENTITY_FLAGS = frozenset(
    {"--model", "--engine", "--model-name", "--revision", "--dtype", "--aux-layer-ids", "--capture-layer-ids"}
)


def model_identity(command: Sequence[str]) -> tuple[str, ...]:
    """The model-deciding part of a server command line: its identity flags with their values, in order.

    Pods whose commands share it serve the same model, so old pods of a rollout that keeps the model still
    serve the current generation's model. (Flag values never start with "--".)
    """
    kept: list[str] = []
    keep = False
    for arg in command:
        if arg.startswith("--"):
            keep = arg in MODEL_IDENTITY_FLAGS
        if keep:
            kept.append(arg)
    return tuple(kept)
