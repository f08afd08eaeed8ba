"""image/build.sh (`make images`) names every image the operator defaults to: where a base cannot be pulled
and the image has no variant on another base (SGLang's CUDA kernels come only from SGLang's image), it says so
in one line and prints the commands that build and push it elsewhere, and succeeds.

A `buildah` that can pull nothing stands in for a machine without registry access (the real one would start
pulling SGLang's image, tens of GB, where the registry is reachable)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_build(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("buildah", "mmdebstrap"):
        (bin_dir / tool).write_text('#!/bin/sh\necho "$0: no registry" >&2\nexit 125\n')
        (bin_dir / tool).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "E3T_IMAGE_STORE": str(tmp_path / "store"),
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
    assert result.returncode == 0, result.stderr
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


def test_an_unknown_image_is_refused_with_the_usage(tmp_path):
    result = run_build(tmp_path, "sglang-gpu")
    assert result.returncode == 2
    assert "usage: " in result.stderr and "[sglang]" in result.stderr
