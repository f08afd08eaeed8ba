"""image/build.sh (`make images`) names every image the operator defaults to: where a base cannot be pulled
and the image has no variant on another base (SGLang's CUDA kernels come only from SGLang's image), it says so
in one line and prints the commands that build and push it elsewhere; `make images` (no argument) then
succeeds, and a build that named the image fails.

A `buildah` that can pull nothing stands in for a machine without registry access (the real one would start
pulling SGLang's image, tens of GB, where the registry is reachable); for a run of every image, one whose
store already holds every image but SGLang's base (all else cached, nothing built)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


NO_REGISTRY = 'echo "$0: no registry" >&2\nexit 125'
# Inspecting any image but SGLang's (lmsysorg/sglang) finds it; a pull finds nothing.
ALL_BUT_SGLANG = """case " $* " in
  *" pull "* | *lmsysorg/sglang*) exit 125 ;;
  *" inspect "*) echo 0123456789abcdef ;;
esac"""


def run_build(tmp_path: Path, *args: str, buildah: str = NO_REGISTRY) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool, body in (("buildah", buildah), ("mmdebstrap", NO_REGISTRY)):
        (bin_dir / tool).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / tool).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "E3T_IMAGE_STORE": str(tmp_path / "store"),
        # Not the checkout's .cache/images, which the image tests read.
        "E3T_IMAGE_REFS": str(tmp_path / "refs"),
        "IMAGE_REGISTRY": "registry.example.com/ml",
    }
    return subprocess.run(
        [ROOT / "image" / "build.sh", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )


def test_an_sglang_base_that_cannot_be_pulled_prints_how_to_build_and_push_the_image(tmp_path):
    version = next(
        line.split('"')[1]
        for line in (ROOT / "pyproject.toml").read_text().splitlines()
        if line.startswith("version")
    )
    release = next(
        line.removeprefix("ARG BASE=")
        for line in (ROOT / "image" / "sglang.Dockerfile").read_text().splitlines()
        if line.startswith("ARG BASE=")
    )
    result = run_build(tmp_path, "sglang")
    # Asked for by name and not built: the commands, then a failure.
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines()[-1] == "==> not built: sglang (named on the command line)"
    image = f"registry.example.com/ml/eagle3-target:{version}-sglang"
    lines = result.stdout.splitlines()
    assert (
        lines[0]
        == f"==> {image}: not built, {release} cannot be pulled here; on a machine that can pull it, run:"
    )
    build, push = lines[1].strip().split(" && ")
    assert build.startswith("docker build -f image/sglang.Dockerfile --build-arg REVISION=")
    assert build.endswith(f" -t {image} .")
    assert push == f"docker push {image}"
    assert "sglangServerImage" in lines[2]


def test_make_images_prints_the_sglang_commands_and_succeeds(tmp_path):
    """With no argument the other images are built (here: cached) and SGLang's is explained, not failed."""
    result = run_build(tmp_path, buildah=ALL_BUT_SGLANG)
    assert result.returncode == 0, result.stderr
    assert "==> eagle3-operator: cached" in result.stdout and "==> eagle3-target: cached" in result.stdout
    assert "eagle3-target:" in result.stdout and "-sglang: not built, lmsysorg/sglang:" in result.stdout
    assert {ref.name for ref in (tmp_path / "refs").iterdir()} == {"eagle3-operator", "eagle3-target"}
    # The same store, SGLang's image named: a failure after the same commands.
    named = run_build(tmp_path, "operator", "sglang", buildah=ALL_BUT_SGLANG)
    assert named.returncode == 1
    assert "-sglang: not built, lmsysorg/sglang:" in named.stdout


def test_an_unknown_image_is_refused_with_the_usage(tmp_path):
    result = run_build(tmp_path, "sglang-gpu")
    assert result.returncode == 2
    assert "usage: " in result.stderr and "[sglang]" in result.stderr
