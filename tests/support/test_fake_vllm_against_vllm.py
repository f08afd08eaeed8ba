"""The vLLM stand-in's claims held to real vLLM (its CPU build): each of `support.vllm_observations` runs
on both and must agree. Real vLLM runs it in a fresh process; the stand-in in this one.

Checked here: the errors engine start gives for configurations it refuses (class and wording), the capture
files one `generate` leaves (names, locks, tensors, dtypes, and the layer order: ascending whatever order
the ids were sent in), and the in-process engine's late files. What real vLLM cannot be made to do stays
the stand-in's fault injection and is not compared: stalled or failed writes, aborted requests, scaled
logits or captures (support/fake_vllm/llm.py), and the worker failures of configurations the runner
refuses before vLLM starts (pipeline parallelism, MLA, classes without the EAGLE-3 interface).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from support import vllm_observations

REPO = Path(__file__).resolve().parents[2]
OBSERVATION_SECONDS = 600  # an engine start and its shutdown on a loaded two-core machine, with room


def on_real_vllm(name: str, model_dir: Path, storage: Path) -> Any:
    done = subprocess.run(
        [sys.executable, "-m", "support.vllm_observations", name, str(model_dir), str(storage)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=OBSERVATION_SECONDS,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def observed(name: str, model_dir: Path, tmp_path: Path) -> tuple[Any, Any]:
    """(real vLLM's observation, the stand-in's); the `fake_vllm` fixture has installed the stand-in."""
    real_storage, stand_in_storage = tmp_path / "real", tmp_path / "stand-in"
    real_storage.mkdir()
    stand_in_storage.mkdir()
    real = on_real_vllm(name, model_dir, real_storage)
    return real, vllm_observations.OBSERVATIONS[name](model_dir, stand_in_storage)


def test_engine_start_refuses_what_vllm_refuses_in_its_words(tiny_llama_dir, fake_vllm, tmp_path):
    real, stand_in = observed("engine_start_errors", tiny_llama_dir, tmp_path)
    assert list(real) == list(stand_in)
    for case, (family, message) in stand_in.items():
        assert real[case][0] == family, (case, real[case])
        # The stand-in's message, up to the cause it adds in parentheses, is vLLM's.
        assert message.split(" (")[0] in real[case][1], (case, real[case][1])


def test_capture_files_are_laid_out_as_vllm_writes_them(tiny_llama_dir, fake_vllm, tmp_path):
    real, stand_in = observed("capture_layout", tiny_llama_dir, tmp_path)
    assert stand_in == real
    ascending = sorted(vllm_observations.CAPTURE_IDS)
    assert real["slot_layers"] == [ascending] * len(vllm_observations.PROMPTS)
    assert all(real["token_ids_are_prompts"]) and real["names_match"] and real["locks"]


def test_the_in_process_engine_writes_a_batch_only_at_the_next_generate(tiny_llama_dir, fake_vllm, tmp_path):
    real, stand_in = observed("in_process_late_files", tiny_llama_dir, tmp_path)
    assert stand_in == real == {"after_generate": False, "a_while_later": False, "after_next_generate": True}
