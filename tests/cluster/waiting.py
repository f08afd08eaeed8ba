"""Polling with a deadline, for conditions that a control plane reaches eventually (no kubelet, no events
to block on), and plain HTTP that never goes through a proxy: every address the tests touch is loopback."""

from __future__ import annotations

import ssl
import time
import urllib.request
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def direct_opener(context: ssl.SSLContext | None = None) -> urllib.request.OpenerDirector:
    """An opener that ignores *_proxy variables: a proxy would take loopback traffic off this machine."""
    return urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
    )


def eventually(check: Callable[[], T], what: str, timeout: float = 60.0, interval: float = 0.2) -> T:
    """Call `check` until it returns something truthy and return that; TimeoutError names `what`."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
