"""The GPU acceptance suite (scripts/smoke_vllm.py --suite): its checks that need no GPU run here against the
vLLM stand-in and tiny models, so its argument parsing, comparisons and JSON lines are tested on CPU."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
from eagle3_target.tiny import write_tiny_model

from support import fake_vllm
from support.scripts import invoke_json_lines, load_script

CPU_CHECKS = [
    "C1-chunked-prefill",
    "C2-many-requests",
    "C3-aux-order",
    "C5-length-boundary",
    "C10-file-hygiene",
]


@pytest.fixture
def script(monkeypatch) -> ModuleType:
    fake_vllm.install(monkeypatch)
    return load_script("smoke_vllm", monkeypatch)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("suite-model"), arch="llama")


def run_suite(script: ModuleType, model_dir: Path, shm: Path, *extra: str) -> tuple[int, list[dict]]:
    args = ["--model", str(model_dir), "--suite", "--device", "cpu", "--dtype", "float32", "--seq-len", "64"]
    return invoke_json_lines(script, [*args, "--hidden-states-dir", str(shm), *extra])


def test_the_cpu_checks_pass_against_the_stand_in(script, model_dir, tmp_path):
    code, lines = run_suite(script, model_dir, tmp_path, "--checks", ",".join(CPU_CHECKS))
    assert [line["check"] for line in lines] == CPU_CHECKS
    assert all(line["pass"] for line in lines), lines
    assert code == 0
    aux_order = lines[2]
    assert aux_order["capture_layer_ids"] == aux_order["requested"] == [5, 1, 3]


def test_cuda_only_checks_say_why_on_cpu_and_pass_nothing(script, model_dir, tmp_path):
    code, lines = run_suite(script, model_dir, tmp_path, "--checks", "C9-cuda-in-parent,C7-memory-headroom")
    assert [line["check"] for line in lines] == ["C9-cuda-in-parent", "C7-memory-headroom"]
    assert all(line["pass"] is None and "needs a CUDA GPU" in line["reason"] for line in lines), lines
    assert code == 0  # nothing failed


def test_a_wrong_layer_fails_its_check_and_the_suite(script, model_dir, tmp_path, monkeypatch):
    def negate_first_aux(states, token_ids):
        states = states.clone()
        states[:, 0] = -states[:, 0]
        return states, token_ids

    monkeypatch.setattr(fake_vllm.LLM, "capture_fault", staticmethod(negate_first_aux))
    code, lines = run_suite(script, model_dir, tmp_path, "--checks", "C2-many-requests,C10-file-hygiene")
    assert [line["pass"] for line in lines] == [False, True]
    assert lines[0]["cosine_per_captured_layer"][0] < 0 < lines[0]["cosine_per_captured_layer"][1]
    assert code == 1


def test_unknown_checks_are_refused(script, model_dir, tmp_path):
    code, lines = run_suite(script, model_dir, tmp_path, "--checks", "C1-chunked-prefill,C99")
    assert code == 2 and lines == []
