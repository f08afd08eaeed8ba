"""Print the part of a lock file (locks/*.txt, hashed) that an image installs on its base: every locked
package the base does not already have, hashes included. What the base installed stays as its release built
it (vLLM's or SGLang's torch and CUDA libraries); a package pyproject.toml pins exactly that the base has at
another version fails the build, naming both, instead of replacing the base's.

Run inside the build with the image's python, in the directory holding pyproject.toml:
    python3 keep_base.py LOCK EXTRA... > rest.txt
"""

import importlib.metadata
import re
import sys
import tomllib

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


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


def main(lock_path: str, extras: list[str]) -> int:
    # Packaging tools are no part of what the base is for.
    installed = {
        canonical(d.metadata["Name"]): d.version
        for d in importlib.metadata.distributions()
        if canonical(d.metadata["Name"]) not in {"pip", "setuptools", "wheel"}
    }
    with open("pyproject.toml", "rb") as pyproject:
        optional = tomllib.load(pyproject)["project"]["optional-dependencies"]
    ours = {
        canonical(match[1]): match[2]
        for extra in extras
        for requirement in optional[extra]
        if (match := PIN.match(requirement))
    }
    with open(lock_path) as lock:
        entries = blocks(lock.read())
    clashes = [
        f"{name}: the base has {installed[name]}, pyproject.toml pins {ours[name]}"
        for name in sorted(ours)
        if name in installed and installed[name] != ours[name]
    ]
    if clashes:
        print(
            "keep_base: the base image disagrees with our pins:\n  " + "\n  ".join(clashes), file=sys.stderr
        )
        return 1
    print("\n".join(text for name, _, text in entries if name not in installed))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
