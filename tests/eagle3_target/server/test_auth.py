"""The bearer-token check every data route sits behind, and what the open /readyz shows without it."""

from __future__ import annotations

import httpx
from eagle3_target.protocol import CLIENT_HEADER, Activity
from eagle3_target.server.auth import bearer_matches

from support.server_farm import ServerFarm
from support.server_process import AUTH_TOKEN
from support.supervision import supervise, token_batch


def test_bearer_matches():
    assert bearer_matches("Bearer tok", "tok")
    assert bearer_matches("bearer tok", "tok")
    assert not bearer_matches(None, "tok")
    assert not bearer_matches("Bearer tok2", "tok")
    assert not bearer_matches("Basic tok", "tok")
    assert not bearer_matches("tok", "tok")


def test_readyz_names_clients_only_to_the_tokens_holder(auth_servers: ServerFarm):
    """On a target with auth, anyone who reaches the port learns how much it is used, not who trains."""
    url = "http://{}:{}".format(*auth_servers.primary)
    ids, mask, _ = token_batch(seed=41, batch=1, seq=6)
    body = {"input_ids": ids, "attention_mask": mask}
    trainer = httpx.Client(
        headers={CLIENT_HEADER: "trainer-secret/7", "Authorization": f"Bearer {AUTH_TOKEN}"}
    )
    supervise(trainer, url, body)
    anyone = Activity.model_validate(httpx.get(f"{url}/readyz").json()["activity"])
    assert anyone.clients == () and anyone.active_clients >= 1 and anyone.requests >= 1
    assert anyone.idle_seconds is not None
    holder = Activity.model_validate(trainer.get(f"{url}/readyz").json()["activity"])
    assert "trainer-secret/7" in {client.id for client in holder.clients}
    wrong = httpx.get(f"{url}/readyz", headers={"Authorization": "Bearer not-the-token"})
    assert wrong.status_code == 200 and wrong.json()["activity"]["clients"] == []
