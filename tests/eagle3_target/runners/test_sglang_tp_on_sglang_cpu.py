"""Tensor parallelism of the SGLang runner against real SGLang 0.5.23 on this CPU: two rank processes joined
by gloo, on tiny Llama and Qwen3 checkpoints with two KV heads (each rank holds one attention and one KV
head) and random norm weights, compared with the HF runner in fp32 within 1e-4. One TP engine is open at a
time (the Llama one, then the Qwen3 one); the last test closes it and checks nothing is left behind.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import psutil
import pytest
import torch
from eagle3_target.runners import InvalidInput, ModelRefused
from eagle3_target.runners.hf import HFRunner
from eagle3_target.runners.sglang import SGLangRunner
from eagle3_target.runners.sglang_tp import CPU_BIND_ENV, SGLANG_SHM_PREFIX
from eagle3_target.tiny import write_tiny_model

from support.sglang_runner import OneEngine
from support.supervision import (
    assert_every_format_matches,
    ragged_rows,
)

ATOL = 1e-4
AUX = [5, 0, 3]
OPTIONS = {"tensor_parallel_size": 2, "max_batch_tokens": 1024, "max_model_len": 128}


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        arch: write_tiny_model(tmp_path_factory.mktemp(f"tp-{arch}"), arch=arch, num_kv_heads=2)
        for arch in ("llama", "qwen3")
    }


class Before(NamedTuple):
    """What ran and what /dev/shm held before the module's first engine."""

    processes: set[int]
    shm: set[str]


@pytest.fixture(scope="module")
def before() -> Before:
    return Before(ranks_running(), set(os.listdir("/dev/shm")))


@pytest.fixture(scope="module")
def engine(paths: dict[str, Path], before: Before) -> Iterator[OneEngine]:
    opened = OneEngine(paths, capture_layer_ids=AUX, **OPTIONS)
    yield opened
    opened.close()


def ranks_running() -> set[int]:
    """This process's live children but multiprocessing's resource tracker (one per interpreter)."""
    return {
        p.pid
        for p in psutil.Process().children(recursive=True)
        if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline())
    }


def test_a_rank_that_fails_to_start_fails_the_runner_with_its_reason(paths, monkeypatch):
    # One CPU share for two ranks: rank 1 finds no share (SGLang's numa_utils asserts) while rank 0 waits
    # for it at the rendezvous; the runner ends rank 0 and reports rank 1's reason.
    monkeypatch.setenv(CPU_BIND_ENV, "0")
    before = ranks_running()
    with pytest.raises(ModelRefused, match=r"rank 1 failed \(start\): AssertionError: NUMA index 1"):
        SGLangRunner.from_pretrained(paths["llama"], dtype="float32", device="cpu", **OPTIONS)
    assert ranks_running() <= before, "a rank process outlived the failed start"


def test_a_batch_budget_beyond_the_kv_cache_is_refused_at_load(paths):
    """SGLang's KV cache holds fewer tokens than --max-batch-tokens (on a GPU: what mem_fraction_static
    leaves): a batch the server accepts would fail in SGLang ("Prefill out of memory"), so loading refuses."""
    before = ranks_running()
    options = {**OPTIONS, "max_total_tokens": 512}
    with pytest.raises(
        ModelRefused, match=r"--max-batch-tokens 1024 is more than the engine's KV cache holds \(\d+ tokens\)"
    ):
        SGLangRunner.from_pretrained(paths["llama"], dtype="float32", device="cpu", **options)
    assert ranks_running() <= before, "a rank process outlived the refused load"


def test_a_batch_sglang_refuses_fails_alone_and_the_ranks_serve_on(engine, paths):
    runner = engine["llama"]
    hf = HFRunner.from_pretrained(paths["llama"], dtype="float32", device="cpu", capture_layer_ids=AUX)
    pool = runner._ranks.pool
    assert pool.tokens >= OPTIONS["max_batch_tokens"]
    rows = pool.tokens // 100 + 1
    too_many = torch.randint(0, 256, (rows, 100))
    # Refused before compute: more tokens than SGLang's KV cache (or more rows than its request pool) holds.
    with pytest.raises(InvalidInput, match=r"the engine's (KV cache|request pool) holds \d+: send fewer"):
        runner.forward_hidden(too_many)
    # Past that check, it fails on every rank (in SGLang's allocation, before any collective), and the ranks
    # stay in step for the next batch.
    with pytest.raises(RuntimeError, match=r"rank [01] failed \(extend\): "):
        runner._ranks.extend(too_many.tolist(), False)
    assert runner.failure is None
    input_ids, mask = ragged_rows(256)
    assert_every_format_matches(runner, hf, input_ids, mask, ATOL)


def test_two_ranks_each_hold_half_the_heads(engine):
    runner = engine["llama"]
    assert runner.engine is None
    assert runner.placements() == [(0, 2, 1, [1, 4, 6]), (1, 2, 1, [1, 4, 6])]


def test_set_capture_layers_reaches_every_rank(engine, paths):
    runner = engine["llama"]
    input_ids, mask = ragged_rows(256)
    valid = mask.bool()
    try:
        runner.set_capture_layers([4, 1, 3])
        assert [p[3] for p in runner.placements()] == [[2, 4, 5], [2, 4, 5]]
        hf = HFRunner.from_pretrained(
            paths["llama"], dtype="float32", device="cpu", capture_layer_ids=[4, 1, 3]
        )
        _, aux = runner.forward_eagle3(input_ids, mask)
        _, hf_aux = hf.forward_eagle3(input_ids, mask)
        torch.testing.assert_close(aux[valid], hf_aux[valid], atol=ATOL, rtol=ATOL)
    finally:
        runner.set_capture_layers(AUX)
    assert [p[3] for p in runner.placements()] == [[1, 4, 6], [1, 4, 6]]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_every_format_matches_the_hf_engine(engine, paths, arch):
    runner = engine[arch]
    hf = HFRunner.from_pretrained(paths[arch], dtype="float32", device="cpu", capture_layer_ids=AUX)
    input_ids, mask = ragged_rows(runner.model.config.vocab_size)
    assert_every_format_matches(runner, hf, input_ids, mask, ATOL)
    prenorm, _ = runner.forward_hidden(input_ids, mask, prenorm=True)
    final, _ = runner.forward_hidden(input_ids, mask)
    assert not torch.allclose(prenorm[mask.bool()], final[mask.bool()], atol=1e-2)


def test_close_and_a_dead_rank_leave_no_process_port_or_shared_memory_file(engine, before):
    runner = engine["qwen3"]
    # Opening the Qwen3 engine closed the Llama one: its ranks are gone, only the two new ones run.
    ranks = sorted(ranks_running() - before.processes)
    assert len(ranks) == 2
    # A rank killed between batches fails the next one with that reason and ends the other rank too.
    psutil.Process(ranks[1]).kill()
    input_ids, mask = ragged_rows(256)
    with pytest.raises(RuntimeError, match=r"SGLang tensor-parallel rank [01] failed \(extend\)"):
        runner.forward_hidden(input_ids, mask)
    assert ranks_running() <= before.processes
    with pytest.raises(RuntimeError, match="ranks have ended"):
        runner.forward_hidden(input_ids, mask)
    assert "SGLang tensor-parallel rank" in (runner.failure or "")
    engine.close()
    for opened in engine.opened:
        with socket.socket() as sock:  # nothing listens on a rendezvous port (closed connections may linger)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", opened.server_args.nccl_port))
    # None of SGLang's shared-memory segments is left, the killed rank's included (only SGLang's own are
    # looked at: other processes on the machine come and go in /dev/shm).
    left = {name for name in set(os.listdir("/dev/shm")) - before.shm if name.startswith(SGLANG_SHM_PREFIX)}
    assert len(engine.opened) == 2 and not left
