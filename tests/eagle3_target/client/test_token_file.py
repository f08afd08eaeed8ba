"""`TargetClient(token_file=...)`: a long run outlives the rotation of the target's token Secret."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from eagle3_target.client import RequestRejected, TargetClient
from eagle3_target.integrations.connect import Connection

from support.cluster.waiting import eventually
from support.secret_volume import SecretVolume
from support.server_process import ServerProcess, status_code
from support.supervision import TokenBatch, token_batch

DEPTH = 2


def test_a_client_reading_a_token_file_keeps_working_across_a_rotation(
    spawn_server: Callable[..., ServerProcess], tiny_llama_dir: Path, tmp_path: Path
):
    secret = SecretVolume(tmp_path / "secret", token="before\n")
    server = spawn_server(tiny_llama_dir, "--auth-token-file", str(secret.path("token")))
    batches = [token_batch(seed=60 + i, batch=1, seq=8) for i in range(6)]

    def server_takes(token: str) -> bool:
        url = f"{server.url}/v1/weights/final_norm"
        return status_code(url, {"Authorization": f"Bearer {token}"}) == 200

    def rotated_after_two() -> Iterator[TokenBatch]:
        """The run's batches; the Secret is rotated while the first ones are in flight."""
        for i, batch in enumerate(batches):
            if i == DEPTH:
                secret.update(token="after\n")
                eventually(lambda: server_takes("after"), "the server to take the new token", timeout=30)
            yield batch

    with (
        TargetClient(server.url, token_file=secret.path("token")) as client,
        Connection(urls=(server.url,), token_file=secret.path("token")).open() as connected,
        TargetClient(server.url, token="before") as fixed,
    ):
        want = [client.batch(*batch) for batch in batches]
        connected.supervise(batches[0].input_ids)
        fixed.supervise(batches[0].input_ids)
        got = list(client.prefetch(rotated_after_two(), depth=DEPTH))
        assert not server_takes("before")
        assert 1 <= client.stats["token_reloads"] <= DEPTH  # one per request that met the old token
        for mine, theirs in zip(got, want, strict=True):
            assert torch.equal(mine.aux_hidden_states, theirs.aux_hidden_states)
            assert torch.equal(mine.logits, theirs.logits)
        connected.supervise(batches[0].input_ids)  # the exporters' and trainers' connections too
        assert connected.stats["token_reloads"] == 1
        with pytest.raises(RequestRejected) as rejected:  # a token given as a string is not re-read
            fixed.supervise(batches[0].input_ids)
        assert rejected.value.status_code == 401
    (tmp_path / "wrong").write_text("wrong\n")
    with (
        TargetClient(server.url, token_file=tmp_path / "wrong") as wrong,
        pytest.raises(RequestRejected) as refused,
    ):
        wrong.supervise(batches[0].input_ids)
    assert refused.value.status_code == 401
    assert wrong.stats["requests"] == 1 and wrong.stats["token_reloads"] == 0  # the same token: not resent


def test_token_and_token_file_are_exclusive(tmp_path: Path):
    (tmp_path / "token").write_text("t")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="token= or token_file=, not both"):
        TargetClient("http://127.0.0.1:9", token="t", token_file=tmp_path / "token")
    with pytest.raises(ValueError, match="is empty"):
        TargetClient("http://127.0.0.1:9", token_file=tmp_path / "empty")
