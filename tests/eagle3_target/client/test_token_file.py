"""`TargetClient(token_file=...)`: a long run outlives the rotation of the target's token Secret, both while
the server still accepts the previous token and after, when the client must read its file again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from eagle3_target.client import RequestRejected, TargetClient
from eagle3_target.integrations.connect import Connection
from eagle3_target.server.app import create_app
from eagle3_target.server.auth import BearerAuthMiddleware, TokenFile
from eagle3_target.server.settings import ServerSettings

from support.cluster.waiting import eventually
from support.secret_volume import SecretVolume
from support.server_process import serve_in_thread, status_code
from support.supervision import TokenBatch, token_batch

DEPTH = 2
GRACE_S = 180.0


def test_a_client_reading_a_token_file_keeps_working_across_a_rotation(tiny_llama_dir: Path, tmp_path: Path):
    """As in a cluster, the server and the trainer each read their own copy of the Secret, and the trainer's
    is updated later. The server's app runs behind the bearer check on a real socket, its grace period's
    clock in the test's hands."""
    served = SecretVolume(tmp_path / "server-secret", token="before\n")
    mounted = SecretVolume(tmp_path / "trainer-secret", token="before\n")
    now = [0.0]
    tokens = TokenFile(served.path("token"), interval_s=0, grace_s=GRACE_S, clock=lambda: now[0])
    app = create_app(ServerSettings(model=str(tiny_llama_dir), engine="hf", dtype="float32"))
    batches = [token_batch(seed=60 + i, batch=1, seq=8) for i in range(8)]

    def server_takes(url: str, token: str) -> bool:
        return status_code(f"{url}/v1/weights/final_norm", {"Authorization": f"Bearer {token}"}) == 200

    def rotated_in_flight(url: str) -> Iterator[TokenBatch]:
        """The run's batches: the server's copy is rotated while the first ones are in flight, the
        trainer's copy two batches later, and the grace period ends at once after that."""
        for i, batch in enumerate(batches):
            if i == DEPTH:
                served.update(token="after\n")
                assert server_takes(url, "after") and server_takes(url, "before")  # the grace period
            if i == 2 * DEPTH:
                mounted.update(token="after\n")
                now[0] += GRACE_S
                assert not server_takes(url, "before")
            yield batch

    with serve_in_thread(BearerAuthMiddleware(app, tokens)) as url:
        eventually(lambda: status_code(f"{url}/readyz") == 200, "the model to load", timeout=180)
        with (
            TargetClient(url, token_file=mounted.path("token")) as client,
            Connection(urls=(url,), token_file=mounted.path("token")).open() as connected,
            TargetClient(url, token="before") as fixed,
        ):
            want = [client.batch(*batch) for batch in batches]
            connected.supervise(batches[0].input_ids)
            fixed.supervise(batches[0].input_ids)
            got = list(client.prefetch(rotated_in_flight(url), depth=DEPTH))
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
            TargetClient(url, token_file=tmp_path / "wrong") as wrong,
            pytest.raises(RequestRejected) as refused,
        ):
            wrong.supervise(batches[0].input_ids)
        assert refused.value.status_code == 401
        assert (
            wrong.stats["requests"] == 1 and wrong.stats["token_reloads"] == 0
        )  # the same token: not resent


def test_token_and_token_file_are_exclusive(tmp_path: Path):
    (tmp_path / "token").write_text("t")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="token= or token_file=, not both"):
        TargetClient("http://127.0.0.1:9", token="t", token_file=tmp_path / "token")
    with pytest.raises(ValueError, match="is empty"):
        TargetClient("http://127.0.0.1:9", token_file=tmp_path / "empty")
