"""The SGLang acceptance suite (scripts/smoke_sglang.py --suite) on real SGLang on this CPU (`make test` runs
this module with .venv-sglang's python), on the tiny Llama: its checks pass against the HF engine, the
CUDA-only ones say why and pass nothing, and a wrong layer or a file left behind fails the suite."""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import ModuleType

import pytest
from eagle3_target.runners import sglang

from support.scripts import invoke_json_lines, load_script

CHECKS = [
    "S1-agreement",
    "S2-aux-order",
    "S3-length-boundary",
    "prefill-throughput",
    "memory-headroom",
    "nothing-left-behind",
]


@pytest.fixture
def script(monkeypatch) -> ModuleType:
    return load_script("smoke_sglang", monkeypatch)


def run_suite(script: ModuleType, model_dir: Path, *extra: str) -> tuple[int, list[dict]]:
    args = ["--model", str(model_dir), "--suite", "--device", "cpu", "--dtype", "float32", "--seq-len", "64"]
    return invoke_json_lines(script, [*args, "--max-batch-tokens", "2048", "--repeats", "1", *extra])


def test_the_suite_passes_on_cpu_and_leaves_the_cuda_checks_open(script, tiny_llama_dir):
    code, lines = run_suite(script, tiny_llama_dir)
    assert [line["check"] for line in lines] == CHECKS
    results = dict(zip(CHECKS, lines, strict=True))
    for name in ["S1-agreement", "S2-aux-order", "S3-length-boundary", "nothing-left-behind"]:
        assert results[name]["pass"] is True, results[name]
    for name in ["prefill-throughput", "memory-headroom"]:
        assert results[name]["pass"] is None and "needs a CUDA GPU" in results[name]["reason"]
    assert code == 0
    agreement = results["S1-agreement"]
    assert agreement["argmax_agreement"] == 1.0 and agreement["mean_abs_logit_diff"] < 1e-4
    assert results["S2-aux-order"]["capture_layer_ids"] == results["S2-aux-order"]["requested"] == [5, 1, 3]
    boundary = results["S3-length-boundary"]
    assert boundary["tokens"] == boundary["max_model_len"] == 16
    assert "takes at most 16" in boundary["longer_row_refused"]
    throughput = results["prefill-throughput"]
    assert throughput["extraction_tokens_per_s"] > 0 and throughput["plain_prefill_tokens_per_s"] > 0


def test_a_wrong_layer_and_a_file_left_behind_fail_the_suite(script, tiny_llama_dir, monkeypatch):
    forward_hidden = sglang.SGLangRunner.forward_hidden
    start_model_runner = sglang.start_model_runner

    def negate_first_aux(self, *args, **kwargs):
        final, aux = forward_hidden(self, *args, **kwargs)
        aux = aux.clone()
        aux[..., : self.model.config.hidden_size] *= -1
        return final, aux

    def leaving_a_file(server_args):
        tempfile.NamedTemporaryFile(delete=False).close()  # what SGLang's PortArgs.init_new does, five times
        return start_model_runner(server_args)

    monkeypatch.setattr(sglang.SGLangRunner, "forward_hidden", negate_first_aux)
    monkeypatch.setattr(sglang, "start_model_runner", leaving_a_file)
    code, lines = run_suite(script, tiny_llama_dir, "--checks", "S1-agreement,nothing-left-behind")
    assert [line["pass"] for line in lines] == [False, False], lines
    assert lines[0]["cosine_per_captured_layer"][0] < 0 < lines[0]["cosine_per_captured_layer"][1]
    assert len(lines[1]["new_scratch_files"]) == 1
    assert code == 1


def test_unknown_checks_are_refused(script, tiny_llama_dir):
    code, lines = run_suite(script, tiny_llama_dir, "--checks", "S1-agreement,S99")
    assert code == 2 and lines == []
