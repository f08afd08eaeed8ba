"""The HF engine's device check (scripts/hf_device_check.py, run by scripts/gpu_check.sh on a GPU): here it
runs CPU against CPU, so its argument parsing, comparisons and JSON lines are tested without a GPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "hf_device_check.py"


def run(*args: str) -> tuple[int, list[dict]]:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=False)
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_cpu_against_cpu_passes_in_both_dtypes():
    code, lines = run("--device", "cpu", "--hidden-size", "64", "--vocab-size", "256", "--seq", "16")
    assert [(line["dtype"], line["pass"]) for line in lines] == [("float32", True), ("bfloat16", True)]
    assert all(line["argmax_agreement"] == 1.0 and line["aux_min_cosine"] > 0.9999 for line in lines)
    assert code == 0


def test_a_permuted_layer_or_a_missing_norm_fails_the_comparison():
    spec = importlib.util.spec_from_file_location("hf_device_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    compare = script.compare
    gen = torch.Generator().manual_seed(0)
    reference = {name: torch.randn(32, 48, generator=gen) for name in ("logits", "aux", "final")}
    assert compare("float32", reference, reference)["pass"]
    assert compare("bfloat16", reference, reference)["pass"]
    permuted = reference | {"aux": reference["aux"].roll(16, dims=-1)}
    assert not compare("bfloat16", permuted, reference)["pass"]
    assert not compare("float32", permuted, reference)["pass"]
    unnormed = reference | {"final": reference["final"] * 3 + 1}
    assert not compare("float32", unnormed, reference)["pass"]
