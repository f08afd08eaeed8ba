"""What the server tests of the vLLM and SGLang engines share: they serve the capture set of the session's HF
server (`tests/eagle3_target/server/conftest.py`: five layers in no sorted order, the last one among them),
so the `layers` format of each can be compared with the HF one's, which test_layers_format.py checks
against transformers."""

from __future__ import annotations

import httpx

from support.server_process import ServerProcess
from support.supervision import assert_close_at_real_positions, supervise, token_batch


def info(server: ServerProcess) -> dict:
    answer = httpx.get(server.url + "/v1/info").json()
    assert isinstance(answer, dict)
    return answer


def assert_layers_match(engine: ServerProcess, hf: ServerProcess, atol: float) -> None:
    """format=layers of `engine`, with each final state, equals the HF server's at the real positions: every
    captured layer (the last decoder layer among them) in capture order."""
    ours, theirs = info(engine), info(hf)
    captured = ours["capture_layer_ids"]
    assert captured == theirs["capture_layer_ids"] and len(captured) == 5
    assert ours["num_hidden_layers"] - 1 in captured
    ids, mask, _ = token_batch(seed=17, batch=3, seq=29, pad_last=9)
    tensors = {"input_ids": ids, "attention_mask": mask}
    with httpx.Client(timeout=120) as client:
        for final in ("prenorm", "postnorm"):
            got, metadata = supervise(client, engine.url, tensors, format="layers", final=final)
            want, _ = supervise(client, hf.url, tensors, format="layers", final=final)
            assert metadata["final"] == final
            assert got["hidden_states"].shape == (*ids.shape, len(captured) * ours["hidden_size"])
            assert_close_at_real_positions(got, want, mask, atol, f"layers final={final}")
