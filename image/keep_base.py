"""Print the part of a lock file (locks/*.txt, hashed) that an image installs on its base: every locked
package the base does not already have, hashes included. What the base installed stays as its release built
it (vLLM's or SGLang's torch and CUDA libraries); a package pyproject.toml pins exactly that the base has at
another version fails the build, naming both, instead of replacing the base's.

--engine DIST leaves to the base's engine the packages DIST itself pins exactly: they stay as the base has
them whatever our extras pin, since the engine's release was built and tested with them (SGLang 0.5.23 pins
torch 2.14.1 and transformers 5.19.0; its CUDA kernels are built against that torch). Every other pin still
fails the build on a clash.

Run inside the build with the image's python, in the directory holding pyproject.toml:
    python3 keep_base.py LOCK EXTRA... [--engine DIST] > rest.txt
"""

import argparse
import importlib.metadata
import re
import sys
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")
# Packaging tools are no part of what the base is for.
TOOLS = {"pip", "setuptools", "wheel"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def blocks(lock: str) -> list[tuple[str, str, str]]:
    """(name, version, text) for each entry of a lock: its requirement line with the hash lines under it."""
    found: list[tuple[str, str, str]] = []
    for line in lock.splitlines():
        if match := PIN.match(line):
            found.append((canonical(match[1]), match[2], line))
        elif found and line.startswith(" ") and not line.lstrip().startswith("#"):
            name, version, text = found[-1]
            found[-1] = (name, version, f"{text}\n{line}")
    return found


def pins(optional: Mapping[str, list[str]], extras: Iterable[str]) -> dict[str, str]:
    """The exact pins of the named extras of pyproject.toml's optional-dependencies."""
    return {
        canonical(match[1]): match[2]
        for extra in extras
        for requirement in optional[extra]
        if (match := PIN.match(requirement))
    }


def engine_pins(requirements: Iterable[str], environment: Mapping[str, str] | None = None) -> set[str]:
    """The packages an engine's metadata pins exactly (==) where its markers hold (no extra's)."""
    # packaging is imported here: only an engine's base needs it, and every engine's requirements include it.
    from packaging.requirements import Requirement

    owned = set()
    for text in requirements:
        requirement = Requirement(text)
        marker_holds = requirement.marker is None or requirement.marker.evaluate(
            {**(environment or {}), "extra": ""}
        )
        if marker_holds and any(spec.operator == "==" for spec in requirement.specifier):
            owned.add(canonical(requirement.name))
    return owned


@dataclass(frozen=True)
class Split:
    """The lock's part an image installs; the clashes that fail its build and the engine's pins kept over
    ours, each by package name, saying which versions differ."""

    rest: str
    clashes: dict[str, str]
    kept: dict[str, str]


def split(lock: str, ours: Mapping[str, str], installed: Mapping[str, str], owned: set[str]) -> Split:
    """The lock's entries the base lacks; our pins the base has at another version (a local label such as
    +cu130 aside), as clashes, or as kept where the engine owns them."""
    differ = {
        name: f"the base has {installed[name]}, pyproject.toml pins {ours[name]}"
        for name in sorted(ours)
        if name in installed and installed[name].partition("+")[0] != ours[name]
    }
    return Split(
        rest="\n".join(text for name, _, text in blocks(lock) if name not in installed),
        clashes={name: why for name, why in differ.items() if name not in owned},
        kept={name: why for name, why in differ.items() if name in owned},
    )


def arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Print the part of a lock an image installs on its base.")
    parser.add_argument("lock")
    parser.add_argument("extras", nargs="+")
    parser.add_argument("--engine", help="the base's engine, whose exact pins stay as the base has them")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = arguments(argv)
    installed = {
        canonical(d.metadata["Name"]): d.version
        for d in importlib.metadata.distributions()
        if canonical(d.metadata["Name"]) not in TOOLS
    }
    with open("pyproject.toml", "rb") as pyproject:
        optional = tomllib.load(pyproject)["project"]["optional-dependencies"]
    owned = engine_pins(importlib.metadata.requires(args.engine) or []) if args.engine else set()
    with open(args.lock) as lock:
        result = split(lock.read(), pins(optional, args.extras), installed, owned)
    if result.clashes:
        print(
            "keep_base: the base image disagrees with our pins:\n  "
            + "\n  ".join(f"{name}: {why}" for name, why in result.clashes.items()),
            file=sys.stderr,
        )
        return 1
    for name, why in result.kept.items():
        print(f"keep_base: keeping {args.engine}'s pin, {name}: {why}", file=sys.stderr)
    print(result.rest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
