"""The stored vocab mappings: a bounded LRU, and NeMo's mappings bound to the connection that posted them."""

from __future__ import annotations

import pytest
from eagle3_target.server.vocab_store import LruDict, NemoMappingBindings, UnboundConnection


def test_lru_dict_forgets_least_recently_used():
    lru: LruDict[int] = LruDict(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # a is now the most recent
    lru.put("c", 3)
    assert lru.get("b") is None and lru.get("a") == 1 and lru.get("c") == 3
    assert len(lru) == 2


def test_nemo_bindings_by_connection_then_host():
    bindings = NemoMappingBindings()
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
