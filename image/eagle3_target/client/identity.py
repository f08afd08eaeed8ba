"""How a client process names itself to target servers (protocol.CLIENT_HEADER), so a server, and through
it the operator, can tell its consumers apart: where it runs (EAGLE3_TARGET_CLIENT if set, else the host
name, which in a pod is the pod's name) and an id of the process (its pid and a random suffix, so a
restarted or forked process is a new consumer)."""

from __future__ import annotations

import functools
import os
import secrets
import socket


def client_id() -> str:
    return _client_id(os.getpid())


@functools.cache
def _client_id(pid: int) -> str:
    where = os.environ.get("EAGLE3_TARGET_CLIENT") or socket.gethostname()
    return f"{where}/{pid}-{secrets.token_hex(3)}"
