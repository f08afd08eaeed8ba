"""Draft-vocab mappings the server keeps for its clients: a bounded LRU per id, never one global.

Native clients name their mapping (``PUT /v1/vocab-mappings/{id}``). NeMo's client names nothing: it posts
``/set_vocab_mapping`` and later ``/generate`` on one keep-alive session. Such mappings are stored under
their content digest and bound to the posting connection, so two trainers with different mappings never
see each other's. When a session reconnects (idle keep-alive closed), the peer host's mapping is used if
that host registered exactly one that is still stored; if it is ambiguous the request fails loudly instead of
guessing.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Container
from typing import Generic, TypeVar

V = TypeVar("V")


class LruDict(Generic[V]):
    """A thread-safe mapping that forgets its least recently used entry beyond ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, V] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, key: str, value: V) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, key: str) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def __contains__(self, key: object) -> bool:
        """Whether `key` is stored, without making it the most recently used."""
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


class UnboundConnection(LookupError):
    """A NeMo client asked for supervision without a vocab mapping this server can tell is its own."""


class NemoMappingBindings:
    """Which mapping id each NeMo client connection, and each client host, registered.

    A host's ids are only those `stored` still holds: each bind and each host lookup drops the evicted ones,
    so a host's set never outgrows the store, and a mapping evicted long ago never makes a reconnect
    ambiguous.
    """

    def __init__(self, stored: Container[str], capacity: int = 4096) -> None:
        self._stored = stored
        self._by_connection: LruDict[str] = LruDict(capacity)
        self._by_host: LruDict[set[str]] = LruDict(capacity)
        self._lock = threading.Lock()

    @staticmethod
    def _connection_key(host: str, port: int) -> str:
        return f"{host}:{port}"

    def bind(self, host: str, port: int, mapping_id: str) -> None:
        with self._lock:
            self._by_connection.put(self._connection_key(host, port), mapping_id)
            host_ids = self._by_host.get(host)
            if host_ids is None:
                host_ids = set()
                self._by_host.put(host, host_ids)
            host_ids.add(mapping_id)
            self._forget_evicted(host_ids)

    def resolve(self, host: str, port: int) -> str:
        """The mapping this connection set, else its host's only stored one; `UnboundConnection` otherwise."""
        mapping_id = self._by_connection.get(self._connection_key(host, port))
        if mapping_id is not None:
            return mapping_id
        with self._lock:
            host_ids = self._by_host.get(host) or set()
            self._forget_evicted(host_ids)
            if len(host_ids) == 1:
                return next(iter(host_ids))
            count = len(host_ids)
        if not count:
            raise UnboundConnection(
                f"no vocab mapping set from {host} is stored (none was, or it was evicted): "
                "POST /set_vocab_mapping before /generate"
            )
        raise UnboundConnection(
            f"{count} different vocab mappings were set from {host} and this connection set none: "
            "POST /set_vocab_mapping again on this connection"
        )

    def _forget_evicted(self, host_ids: set[str]) -> None:
        host_ids.difference_update([mapping_id for mapping_id in host_ids if mapping_id not in self._stored])
