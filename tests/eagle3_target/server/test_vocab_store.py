"""The stored vocab mappings: a bounded LRU, and NeMo's mappings bound to the connection that posted them."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from eagle3_target.contract import VocabMapping
from eagle3_target.server.app import create_app
from eagle3_target.server.settings import ServerSettings
from eagle3_target.server.vocab_store import LruDict, NemoMappingBindings, UnboundConnection
from eagle3_target.wire import nemo as nemo_wire

from support.cluster.waiting import eventually
from support.server_process import serve_in_thread, status_code
from support.supervision import assert_error, draft_mapping, put_mapping, token_batch


def test_lru_dict_forgets_least_recently_used():
    lru: LruDict[int] = LruDict(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # a is now the most recent
    lru.put("c", 3)
    assert lru.get("b") is None and lru.get("a") == 1 and lru.get("c") == 3
    assert len(lru) == 2


def stored(*ids: str, capacity: int = 64) -> LruDict[str]:
    """A mapping store holding `ids`, as the server's is filled before each bind."""
    store: LruDict[str] = LruDict(capacity)
    for mapping_id in ids:
        store.put(mapping_id, mapping_id)
    return store


def test_nemo_bindings_by_connection_then_host():
    bindings = NemoMappingBindings(stored("map-a", "map-b"))
    with pytest.raises(UnboundConnection, match="set_vocab_mapping"):
        bindings.resolve("10.0.0.1", 5000)
    bindings.bind("10.0.0.1", 5000, "map-a")
    assert bindings.resolve("10.0.0.1", 5000) == "map-a"
    # A reconnect from the same host that only ever set one mapping keeps using it.
    assert bindings.resolve("10.0.0.1", 6000) == "map-a"
    bindings.bind("10.0.0.1", 5001, "map-b")
    assert bindings.resolve("10.0.0.1", 5000) == "map-a"
    assert bindings.resolve("10.0.0.1", 5001) == "map-b"
    with pytest.raises(UnboundConnection, match="2 different vocab mappings"):
        bindings.resolve("10.0.0.1", 6000)
    with pytest.raises(UnboundConnection):
        bindings.resolve("10.0.0.2", 5000)


def test_lru_dict_membership_leaves_the_order_alone():
    lru = stored("a", "b", capacity=2)
    assert "a" in lru and "z" not in lru
    lru.put("c", "c")  # "a" is still the least recently used, so it goes
    assert "a" not in lru and "b" in lru


def test_nemo_bindings_forget_evicted_mappings():
    """300 mappings set from one host, 64 stored: a reconnect counts the stored ones only."""
    store = stored()
    bindings = NemoMappingBindings(store)
    for n in range(300):
        store.put(f"map-{n}", f"map-{n}")
        bindings.bind("10.0.0.1", 5000 + n, f"map-{n}")
    with pytest.raises(UnboundConnection, match=r"^64 different vocab mappings were set from 10\.0\.0\.1"):
        bindings.resolve("10.0.0.1", 9000)
    assert bindings.resolve("10.0.0.1", 5299) == "map-299"  # a connection's own binding still wins


def test_a_host_whose_other_mapping_was_evicted_resolves_to_its_live_one():
    store = stored(capacity=2)
    bindings = NemoMappingBindings(store)
    store.put("old", "old")
    bindings.bind("10.0.0.1", 5000, "old")
    store.put("other-host", "other-host")
    bindings.bind("10.0.0.2", 5000, "other-host")
    store.put("new", "new")  # evicts "old"
    bindings.bind("10.0.0.1", 5001, "new")
    assert bindings.resolve("10.0.0.1", 6000) == "new"
    store.put("native", "native")  # evicts "other-host": that host has nothing stored any more
    with pytest.raises(UnboundConnection, match=r"no vocab mapping set from 10\.0\.0\.2 is stored"):
        bindings.resolve("10.0.0.2", 6000)


def nemo_post(url: str, path: str, **tensors: object) -> httpx.Response:
    """One request on a connection of its own, as a NeMo session that reconnected."""
    with httpx.Client(timeout=60, trust_env=False) as session:
        return session.post(url + path, content=nemo_wire.encode(tensors))


def set_nemo_mapping(url: str, mapping: VocabMapping) -> None:
    response = nemo_post(
        url,
        "/set_vocab_mapping",
        selected_token_ids=mapping.selected_token_ids,
        selected_token_mask=mapping.selected_token_mask,
    )
    assert response.status_code == 200, response.text


def test_a_reconnecting_nemo_session_counts_only_stored_mappings(server_model_dir: Path):
    """Two mappings are kept; three are set from this host, each on its own connection, then one native."""
    app = create_app(
        ServerSettings(model=str(server_model_dir), engine="hf", dtype="float32", max_vocab_mappings=2)
    )
    ids, mask, loss_mask = token_batch(seed=5, batch=1, seq=8)
    with serve_in_thread(app) as url:
        eventually(lambda: status_code(url + "/readyz") == 200, "the model to load", timeout=180)
        for seed in (1, 2, 3):
            set_nemo_mapping(url, draft_mapping(16, seed=seed))
        generate = nemo_post(url, "/generate", input_ids=ids, attention_mask=mask, loss_mask=loss_mask)
        assert "2 different vocab mappings" in assert_error(generate, 404, "not_found")["message"]
        with httpx.Client(timeout=60, trust_env=False) as client:  # evicts the second NeMo mapping
            assert put_mapping(client, url, "native", draft_mapping(16, seed=4)).status_code == 200
        generate = nemo_post(url, "/generate", input_ids=ids, attention_mask=mask, loss_mask=loss_mask)
        assert generate.status_code == 200, generate.text
        assert nemo_wire.decode(generate.content)["target_probs"].shape == (1, 8, 16)
