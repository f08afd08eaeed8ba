"""The distribution installs from the repository: `make wheel` builds the wheel `pip install` builds from a
git URL, with both packages whole, every extra and both commands; installed on its own (no repository on the
path), the client imports and `eagle3-target` runs."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
UV = ROOT / ".cache" / "uv" / "bin" / "uv"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run(["make", "--no-print-directory", "wheel", f"DIST={dist}"], cwd=ROOT, check=True)
    (built,) = dist.glob("*.whl")
    assert built.name == f"eagle3_target-{PROJECT['version']}-py3-none-any.whl"
    return built


def dist_info(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(f"eagle3_target-{PROJECT['version']}.dist-info/{name}").decode()


def test_the_wheel_names_the_project_its_extras_and_their_requirements(wheel):
    metadata = Parser().parsestr(dist_info(wheel, "METADATA"))
    assert (metadata["Name"], metadata["Version"]) == ("eagle3-target", PROJECT["version"])
    assert {"client", "server"} <= set(metadata.get_all("Provides-Extra"))
    requirements = [Requirement(text) for text in metadata.get_all("Requires-Dist")]
    for extra in ("client", "server"):
        in_wheel = {
            f"{r.name}{r.specifier}"
            for r in requirements
            if r.marker is None or r.marker.evaluate({"extra": extra})
        }
        declared = {
            str(Requirement(text))
            for text in PROJECT["dependencies"] + PROJECT["optional-dependencies"][extra]
        }
        assert in_wheel == declared, extra


def test_the_wheel_installs_both_commands(wheel):
    entry_points = dist_info(wheel, "entry_points.txt")
    assert "eagle3-target = eagle3_target.cli:main" in entry_points
    assert "eagle3-operator = eagle3_operator.cli:main" in entry_points


def test_the_wheel_holds_every_file_of_both_packages(wheel):
    tracked = subprocess.run(
        ["git", "ls-files", "image/eagle3_target", "operator/eagle3_operator"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert tracked
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    missing = [path for path in tracked if path.split("/", 1)[1] not in names]
    assert missing == []


def test_the_installed_wheel_imports_the_client_and_runs_the_command(wheel, tmp_path):
    """A fresh environment with the wheel alone (--no-deps); its dependencies come from .venv's site-packages
    through a .pth, as .venv-sglang's do, after the environment's own: eagle3_target is the wheel's."""
    venv = tmp_path / "venv"
    subprocess.run([UV, "venv", "--quiet", "--python", sys.executable, venv], check=True)
    python = venv / "bin" / "python"
    subprocess.run([UV, "pip", "install", "--quiet", "--python", python, "--no-deps", wheel], check=True)
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    base = next((ROOT / ".venv" / "lib").glob("python3*/site-packages"))
    (Path(site) / "project_dependencies.pth").write_text(f"import site; site.addsitedir({str(base)!r})\n")

    probe = (
        "import eagle3_target; from eagle3_target.client import TargetClient, resolve; "
        "print(eagle3_target.__file__)"
    )
    imported = subprocess.run([python, "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip().startswith(site), imported.stdout

    command = venv / "bin" / "eagle3-target"
    assert command.read_text().splitlines()[0] == f"#!{python}"
    help_text = subprocess.run([command, "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert help_text.returncode == 0, help_text.stderr
    assert "serve" in help_text.stdout
