"""The vLLM capture layout and its files (runners/vllm_capture.py): HF capture ids to vLLM capture ids and
back to the requested order, and, through the runner on the vLLM stand-in, bad, failed, stalled and aborted
captures as clear errors that leave no file behind."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from eagle3_target.runners.vllm_capture import engine_capture_ids, file_positions

from support.vllm_runner import open_runner, ragged_batch


def test_capture_ids_and_file_order():
    assert engine_capture_ids([1, 15, 28], 32) == [2, 16, 29, 32]
    assert engine_capture_ids([28, 1, 15], 32) == [2, 16, 29, 32]
    assert file_positions([28, 1, 15], [2, 16, 29, 32]) == [2, 0, 1]
    # The last layer is the final pre-norm state vLLM captures as id L anyway: asked for once.
    assert engine_capture_ids([31, 0], 32) == [1, 32]
    assert file_positions([31, 0], [1, 32]) == [1, 0]
    with pytest.raises(ValueError, match="capture layer id 32 is out of range"):
        engine_capture_ids([1, 15, 32], 32)
    with pytest.raises(ValueError, match="distinct"):
        engine_capture_ids([1, 1, 2], 32)


def test_a_bad_capture_set_is_refused_before_the_engine_starts(tiny_llama_dir, fake_vllm, shm):
    with pytest.raises(ValueError, match=r"capture layer id 8 is out of range"):
        open_runner(tiny_llama_dir, shm, capture_layer_ids=[1, 3, 8])
    assert fake_vllm.LLM.created == []
    assert list(shm.iterdir()) == [], "a failed start must not leave its capture directory behind"


def zero_layer(states, token_ids):
    states = states.clone()
    states[:, 1] = 0
    return states, token_ids


def nan_value(states, token_ids):
    states = states.clone()
    states[2, 0, 5] = float("nan")
    return states, token_ids


def drop_last_position(states, token_ids):
    return states[:-1], token_ids[:-1]


def other_tokens(states, token_ids):
    return states, (token_ids + 1) % 256


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        (zero_layer, r"all-zero hidden states at file slot\(s\) \[1\]"),
        (nan_value, r"non-finite"),
        (drop_last_position, r"captured 10 positions .* for a 11-token prompt"),
        (other_tokens, r"token_ids differ from the prompt"),
    ],
)
def test_bad_captures_are_refused_and_files_removed(
    tiny_llama_dir, fake_vllm, shm, monkeypatch, fault, message
):
    runner = open_runner(tiny_llama_dir, shm)
    # One slow writer thread: rows 1-2 are still being written when row 0 fails; their files must be
    # deleted after the writes end, or they reappear.
    llm = fake_vllm.LLM.created[-1]
    llm.writer = ThreadPoolExecutor(max_workers=1)
    monkeypatch.setattr(fake_vllm.LLM, "capture_fault", staticmethod(fault))
    input_ids, mask = ragged_batch(256)
    with pytest.raises(RuntimeError, match=message):
        runner.forward_eagle3(input_ids, mask)
    assert not any(runner.hidden_states_dir.iterdir()), "every row's file must be removed after a failure"
    # The engine keeps serving once the fault is gone.
    monkeypatch.setattr(fake_vllm.LLM, "capture_fault", None)
    _, aux_states = runner.forward_eagle3(input_ids, mask)
    assert torch.isfinite(aux_states).all()
    assert not any(runner.hidden_states_dir.iterdir()), "no write of the failed call may land afterwards"
    runner.close()


@pytest.mark.timeout(60)
def test_a_write_that_never_ends_is_a_bounded_error_and_the_engine_keeps_serving(
    tiny_llama_dir, fake_vllm, shm
):
    runner = open_runner(tiny_llama_dir, shm, capture_timeout_s="0.5")
    llm = fake_vllm.LLM.created[-1]
    llm.stall_write_rows = {1}
    input_ids, mask = ragged_batch(256)
    with pytest.raises(
        RuntimeError, match=r"row 1: vLLM's connector did not finish writing .* within 0\.5 s"
    ):
        runner.forward_eagle3(input_ids, mask)
    llm.stall_write_rows = set()
    # The next batch is served while the stalled write is still pending.
    _, aux_states = runner.forward_eagle3(input_ids, mask)
    assert torch.isfinite(aux_states).all()
    assert len(list(runner.hidden_states_dir.iterdir())) == 1, "only the stalled write's lock is left"
    # When the write finally lands, the next batch removes its file and lock.
    llm.release_stalled_writes()
    runner.forward_eagle3(input_ids, mask)
    assert not any(runner.hidden_states_dir.iterdir())
    runner.close()


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        # vLLM only logs a failed write (`_on_write_done`) and releases the lock: no file appears.
        ("fail_write_rows", r"row 1: vLLM's connector wrote no capture file"),
        # An aborted request comes back without a token, but its file is still written.
        ("abort_rows", r"row 1: vLLM returned no token \(finish reason: abort\)"),
    ],
)
def test_a_failed_write_or_aborted_request_is_a_clear_error_and_leaks_no_files(
    tiny_llama_dir, fake_vllm, shm, fault, message
):
    runner = open_runner(tiny_llama_dir, shm)
    llm = fake_vllm.LLM.created[-1]
    setattr(llm, fault, {1})
    input_ids, mask = ragged_batch(256)
    with pytest.raises(RuntimeError, match=message):
        runner.forward_eagle3(input_ids, mask)
    assert not any(runner.hidden_states_dir.iterdir()), "every row's file must be removed after a failure"
    setattr(llm, fault, set())
    _, aux_states = runner.forward_eagle3(input_ids, mask)
    assert torch.isfinite(aux_states).all()
    runner.close()
