"""NeMo AutoModel's remote-target protocol, played as its client does: one keep-alive session per server,
wire-format bodies, ``/set_vocab_mapping`` then ``/generate``; answers compared with NeMo's co-located
batch (``contract.build_batch`` with the mapping) computed in process."""

from __future__ import annotations

import json

import httpx
import torch
from eagle3_target.wire import nemo as nemo_wire

from support.nemo_client import (
    assert_generate_matches,
    generate,
    loss_mask_for,
    nemo_reference,
    nemo_session,
    set_mapping,
)
from support.supervision import assert_error, draft_mapping, token_batch


def test_nemo_client_protocol(server, reference_runner):
    mapping = draft_mapping(64, seed=31)
    ids, mask, _ = token_batch(32, 2, 20, pad_last=5)
    loss_mask = loss_mask_for(mask)
    with nemo_session() as session:
        assert session.get(server.url + "/health").json() == {"status": "ok"}
        info = session.post(server.url + "/model_info", content=b"").json()
        config = reference_runner.model.config
        assert info == {
            "num_hidden_layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "aux_layer_ids": [1, 3, 4],  # the aux layers, not the wider capture set
        }
        embeddings = nemo_wire.decode(session.post(server.url + "/input_embeddings", content=b"").content)
        assert torch.equal(embeddings["weight"], reference_runner.input_embedding_weight())
        nccl = session.post(server.url + "/init_nccl", content=json.dumps({"nccl_port": 8101}).encode())
        assert nccl.json() == {"status": "disabled"}
        assert session.post(server.url + "/heartbeat").json()["status"] == "ok"
        answer = set_mapping(session, server.url, mapping)
        assert answer.json() == {"status": "ok", "vocab_id": mapping.digest()}
        response = generate(session, server.url, ids, mask, loss_mask)
        assert_generate_matches(response, nemo_reference(reference_runner, ids, mask, loss_mask, mapping))
        # NeMo's close() posts /disconnect: acknowledged, and the server keeps serving.
        assert session.post(server.url + "/disconnect", content=b"{}").json() == {"status": "ok"}
    assert httpx.get(server.url + "/healthz").status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


def test_two_trainers_with_different_mappings_do_not_overwrite_each_other(server, reference_runner):
    first, second = draft_mapping(50, seed=41), draft_mapping(90, seed=42)
    ids, mask, _ = token_batch(43, 1, 18)
    loss_mask = loss_mask_for(mask)
    with nemo_session() as trainer_a, nemo_session() as trainer_b:
        assert set_mapping(trainer_a, server.url, first).status_code == 200
        assert set_mapping(trainer_b, server.url, second).status_code == 200
        got_a = generate(trainer_a, server.url, ids, mask, loss_mask)
        got_b = generate(trainer_b, server.url, ids, mask, loss_mask)
        assert_generate_matches(got_a, nemo_reference(reference_runner, ids, mask, loss_mask, first))
        assert_generate_matches(got_b, nemo_reference(reference_runner, ids, mask, loss_mask, second))
        # A third connection from the same host that set nothing cannot know which trainer it is.
        with nemo_session() as stranger:
            error = assert_error(generate(stranger, server.url, ids, mask, loss_mask), 404, "not_found")
        assert "set_vocab_mapping" in error["message"]
        # Trainer A's next step still gets its own mapping.
        again = generate(trainer_a, server.url, ids, mask, loss_mask)
        assert_generate_matches(again, nemo_reference(reference_runner, ids, mask, loss_mask, first))


def test_nemo_bad_bodies(server):
    with nemo_session() as session:
        assert_error(session.post(server.url + "/set_vocab_mapping", content=b"NOPE" * 8), 400, "bad_request")
        ids = torch.tensor([1, 2, 3])
        wrong_mask = torch.zeros(10, dtype=torch.bool)
        wrong_mask[ids] = True
        body = nemo_wire.encode({"selected_token_ids": ids, "selected_token_mask": wrong_mask})
        assert_error(session.post(server.url + "/set_vocab_mapping", content=body), 422, "invalid_input")
        inconsistent = torch.zeros(256, dtype=torch.bool)
        body = nemo_wire.encode({"selected_token_ids": ids, "selected_token_mask": inconsistent})
        assert_error(session.post(server.url + "/set_vocab_mapping", content=body), 422, "invalid_input")
        assert set_mapping(session, server.url, draft_mapping(16, seed=5)).status_code == 200
        assert_error(session.post(server.url + "/generate", content=b"\x00" * 64), 400, "bad_request")
        no_loss_mask = nemo_wire.encode(
            {"input_ids": torch.ones(1, 4, dtype=torch.int64), "attention_mask": None}
        )
        assert_error(session.post(server.url + "/generate", content=no_loss_mask), 422, "invalid_input")
        ids, mask, _ = token_batch(1, 1, 6)
        ok = generate(session, server.url, ids, mask, mask)
        assert ok.status_code == 200


def test_nemo_requests_through_an_http_proxy_are_refused_not_given_another_trainers_vocabulary(server):
    """A proxy (Envoy in a mesh) reuses its upstream connections for any client, so a mapping bound to the
    connection could reach another trainer's /generate: such requests are refused with the way out."""
    ids, mask, _ = token_batch(44, 1, 8)
    with nemo_session() as session:
        for headers in (
            {"X-Forwarded-For": "10.0.0.7"},
            {"Via": "1.1 proxy"},
            {"x-envoy-attempt-count": "1"},
        ):
            payload = nemo_wire.encode(
                {"selected_token_ids": torch.arange(8), "selected_token_mask": torch.arange(256) < 8}
            )
            refused = session.post(server.url + "/set_vocab_mapping", content=payload, headers=headers)
            body = assert_error(refused, 400, "bad_request")
            assert "through an HTTP proxy" in body["message"]
            assert next(iter(headers)).lower() in body["message"]
        assert set_mapping(session, server.url, draft_mapping(16, seed=6)).status_code == 200
        proxied = session.post(server.url + "/generate", content=b"", headers={"Forwarded": "for=10.0.0.7"})
        assert "/v1/vocab-mappings" in assert_error(proxied, 400, "bad_request")["message"]
        assert generate(session, server.url, ids, mask, mask).status_code == 200  # direct: served
