"""scripts/check_prereqs.sh (`make setup`, `make demo`) names each missing prerequisite and what to do, and
fails: an older Go, a missing Python 3.11, a machine other than x86_64 Linux. Fake `go` and `uname` on PATH
report what another machine would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_prereqs.sh"
NEEDED_GO = next(
    line.split()[1]
    for line in (ROOT / "support" / "cluster" / "tools" / "go.mod").read_text().splitlines()
    if line.startswith("go ")
)


def check(
    tmp_path: Path,
    *args: str,
    go: str | None,
    machine: str = "Linux x86_64",
    python: str = sys.executable,
    more_fakes: dict[str, str] | None = None,
):
    """The script run with a `go` reporting GO (None: no go on PATH) on a machine reporting MACHINE, and
    more fakes on PATH (name -> shell body)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os_name, arch = machine.split()
    fakes = {"uname": f'case "$1" in -s) echo {os_name} ;; -m) echo {arch} ;; esac'}
    if go is not None:
        fakes["go"] = f'[ "$*" = "env GOVERSION" ] && echo go{go}'
    fakes.update(more_fakes or {})
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    # Only what the script itself runs besides the fakes: a shell's tools, with no go among them.
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("bash", "sed", "sort", "head", "dirname", "printf"):
        (tools / tool).symlink_to(
            subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip()
        )
    env = {**os.environ, "PATH": f"{bin_dir}:{tools}", "PYTHON": python}
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, env=env, timeout=30)


def test_a_machine_with_everything_passes_silently(tmp_path):
    result = check(tmp_path, go=NEEDED_GO)
    assert (result.returncode, result.stderr) == (0, "")


def test_an_older_go_is_named_with_the_version_needed(tmp_path):
    result = check(tmp_path, go="1.25.3")
    assert result.returncode == 1
    assert f"==> prerequisite: Go 1.25.3 is older than Go {NEEDED_GO}" in result.stderr
    assert f"install Go {NEEDED_GO} or newer (https://go.dev/dl/)" in result.stderr


def test_a_newer_go_passes(tmp_path):
    major, minor, _ = NEEDED_GO.split(".")
    assert check(tmp_path, "go", go=f"{major}.{int(minor) + 1}.0").returncode == 0


def test_no_go_at_all_is_named(tmp_path):
    result = check(tmp_path, "go", go=None)
    assert result.returncode == 1
    assert f"==> prerequisite: go is not on PATH: install Go {NEEDED_GO} or newer" in result.stderr


def test_a_missing_python_is_named(tmp_path):
    result = check(tmp_path, "python", go=NEEDED_GO, python="python3.11-not-here")
    assert result.returncode == 1
    assert "==> prerequisite: python3.11-not-here is not on PATH: install Python 3.11" in result.stderr


@pytest.mark.parametrize(("answer", "named"), [("echo 3.12", "Python 3.12"), ("exit 1", "no working Python")])
def test_a_python_other_than_3_11_is_named(tmp_path, answer, named):
    """PYTHON=python3 found on PATH but a 3.12 (or not a Python at all): a fake python3 on PATH answers
    the version query as one would."""
    result = check(tmp_path, "python", go=NEEDED_GO, python="python3", more_fakes={"python3": answer})
    assert result.returncode == 1
    assert (
        f"==> prerequisite: python3 is {named}; every environment is made with Python 3.11" in result.stderr
    )


@pytest.mark.parametrize("machine", ["Darwin arm64", "Linux aarch64"])
def test_a_machine_other_than_x86_64_linux_is_named(tmp_path, machine):
    result = check(tmp_path, go=NEEDED_GO, machine=machine)
    assert result.returncode == 1
    assert (
        f"==> prerequisite: this machine is {machine}; the local set-up needs x86_64 Linux" in result.stderr
    )


def test_every_missing_piece_is_named_at_once(tmp_path):
    result = check(tmp_path, go="1.20.1", machine="Darwin arm64", python="python3.11-not-here")
    assert result.returncode == 1
    assert result.stderr.count("==> prerequisite:") == 3
