"""The server's command line follows the spec, optional flags appear only when set (so a new field leaves
the pods of targets without it as they were), the server's own command line parser reads it back, and no
flag has an env twin a target author could set."""

import typer
from eagle3_operator.constants import AUTH_MOUNT, OPERATOR_ENV
from eagle3_operator.render.server_command import model_identity, server_args
from eagle3_operator.spec import Eagle3TargetSpec
from eagle3_target.cli import app
from eagle3_target.server.cli import given_flags
from eagle3_target.server.settings import ServerSettings

from support.rendering import (
    HF_SOURCE,
    flag,
    make_spec,
    server_of,
)


def test_server_command_line_follows_the_spec():
    spec = make_spec(
        {"pvc": {"claimName": "models"}},
        engine="vllm",
        tensorParallelSize=2,
        auxLayerIds=[2, 9, 5],
        maxModelLen=4096,
        engineArgs={"max-num-seqs": "8", "enforce-eager": "true", "gpu-memory-utilization": "0.85"},
        auth={"tokenSecretRef": {"name": "target-token", "key": "bearer"}},
    )
    command = server_of(spec)["command"]
    assert command[:2] == ["eagle3-target", "serve"]
    assert flag(command, "--model") == "/models"
    assert flag(command, "--engine") == "vllm"
    assert flag(command, "--port") == "8000"
    assert flag(command, "--tensor-parallel-size") == "2"
    assert flag(command, "--max-model-len") == "4096"
    assert flag(command, "--model-name") == "org/tiny-model"
    aux = command.index("--aux-layer-ids")
    assert command[aux + 1 : aux + 4] == ["2", "9", "5"]  # the requested order, which sets the concat order
    engine_args = [command[i + 1] for i, part in enumerate(command) if part == "--engine-arg"]
    assert engine_args == ["enforce-eager=true", "gpu-memory-utilization=0.85", "max-num-seqs=8"]
    assert flag(command, "--auth-token-file") == f"{AUTH_MOUNT}/bearer"
    assert "--trust-remote-code" not in command
    assert "--dtype" not in command and "--revision" not in command


def test_optional_flags_appear_only_when_set():
    spec = make_spec(engine="hf", tensorParallelSize=0)
    command = server_of(spec)["command"]
    for absent in (
        "--tensor-parallel-size",
        "--max-model-len",
        "--aux-layer-ids",
        "--capture-layer-ids",
        "--engine-arg",
        "--auth-token-file",
    ):
        assert absent not in command
    model = {
        "name": "m",
        "revision": "abc123",
        "dtype": "bfloat16",
        "trustRemoteCode": True,
        "source": {"hostPath": {"path": "/m"}},
    }
    command = server_of(Eagle3TargetSpec.parse({"model": model, "engine": "hf"}))["command"]
    assert flag(command, "--dtype") == "bfloat16"
    assert flag(command, "--revision") == "abc123"
    assert command[-1] == "--trust-remote-code"


def test_a_spec_without_a_capture_set_renders_the_command_it_always_had():
    """An operator upgrade must not roll every target: a spec that does not set the new field keeps its
    command line word for word."""
    spec = make_spec(engine="vllm", auxLayerIds=[2, 9, 5], maxModelLen=4096, engineArgs={"b": "2", "a": "1"})
    assert server_args(spec) == [
        *("eagle3-target", "serve", "--model", "/models", "--engine", "vllm", "--host", "0.0.0.0"),
        *("--port", "8000", "--model-name", "org/tiny-model", "--metrics-port", "9090"),
        *("--aux-layer-ids", "2", "9", "5", "--tensor-parallel-size", "1", "--max-model-len", "4096"),
        *("--engine-arg", "a=1", "--engine-arg", "b=2"),
    ]
    captured = server_args(make_spec(engine="vllm", auxLayerIds=[2, 9, 5], captureLayerIds=[9, 0, 2, 5, 11]))
    at = captured.index("--capture-layer-ids")
    assert captured[at - 4 : at + 2] == [
        "--aux-layer-ids",
        "2",
        "9",
        "5",
        "--capture-layer-ids",
        "9,0,2,5,11",
    ]
    assert captured[:at] + captured[at + 2 :] == server_args(make_spec(engine="vllm", auxLayerIds=[2, 9, 5]))


def test_the_server_reads_the_layer_ids_it_is_given():
    """The rendered words parse with `eagle3-target serve`'s own parser into the spec's ids, in order."""
    spec = make_spec(engine="hf", auxLayerIds=[2, 9, 5], captureLayerIds=[9, 0, 2, 5, 11])
    serve = typer.main.get_command(app).commands["serve"]
    context = serve.make_context("serve", server_args(spec)[2:])
    settings = ServerSettings(**given_flags(context.params))
    assert (settings.aux_layer_ids, settings.capture_layer_ids) == ((2, 9, 5), (9, 0, 2, 5, 11))


def test_a_changed_capture_set_changes_the_served_model():
    """The capture set is part of the fingerprint, so pods with another one do not serve the current model."""
    one, other = (model_identity(server_args(make_spec(captureLayerIds=ids))) for ids in ([1, 2], [1, 3]))
    assert one != other
    assert model_identity(server_args(make_spec())) != one


def test_every_flag_the_operator_passes_has_its_env_twin_refused():
    """A spec.env entry naming a setting the command line already sets would be silently ignored."""
    model = {"name": "m", "dtype": "bfloat16", "trustRemoteCode": True, "source": HF_SOURCE}
    spec = Eagle3TargetSpec.parse(
        {
            "model": model,
            "auxLayerIds": [1, 2, 3],
            "captureLayerIds": [1, 2, 3, 4],
            "maxModelLen": 64,
            "engineArgs": {"a": "b"},
            "auth": {"tokenSecretRef": {"name": "t"}},
        }
    )
    flags = [part for part in server_args(spec)[2:] if part.startswith("--")]
    twins = {f"EAGLE3_TARGET_{flag[2:].replace('-', '_').upper()}" for flag in flags}
    twins = {"EAGLE3_TARGET_ENGINE_ARGS" if twin == "EAGLE3_TARGET_ENGINE_ARG" else twin for twin in twins}
    assert twins <= OPERATOR_ENV
