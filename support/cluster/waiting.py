"""Polling with a deadline, for conditions that a control plane or a server process reaches eventually (no
kubelet, no events to block on), free loopback ports, and plain HTTP that never goes through a proxy: every
address the tests, benchmarks and demo touch is loopback."""

from __future__ import annotations

import socket
import ssl
import time
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A loopback port nothing listens on right now (the kernel picks it)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def direct_opener(context: ssl.SSLContext | None = None) -> urllib.request.OpenerDirector:
    """An opener that ignores *_proxy variables: a proxy would take loopback traffic off this machine."""
    return urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
    )


def eventually(check: Callable[[], T], what: str, timeout: float = 90.0, interval: float = 0.2) -> T:
    """Call `check` until it returns something truthy and return that; TimeoutError names `what` and the
    last value seen, so a failure says how far things got. The default timeout leaves room for an operator
    reconcile that sits out a retry backoff first."""
    deadline = time.monotonic() + timeout
    while True:
        last: Any = check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")
        time.sleep(interval)
