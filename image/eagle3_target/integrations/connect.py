"""A `TargetClient` from what a user types: a resource name (resolved and followed) or server URLs, and an
optional bearer-token file. Shared by the exporters and the speculators backend."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from eagle3_target.client.target_client import TargetClient
from eagle3_target.protocol import read_token_file


def connect(
    target: str | None,
    urls: Sequence[str] = (),
    *,
    namespace: str | None = None,
    token_file: Path | None = None,
    wait: float = 300.0,
    kubeconfig: str | None = None,
) -> TargetClient:
    """A client of the `Eagle3Target` named `target`, or of the servers at `urls`: exactly one of them."""
    if (target is None) == (not urls):
        raise ValueError("give either a target name (--target) or its server URLs (--url), not both")
    if target is not None and "://" in target:
        raise ValueError(f"--target takes an Eagle3Target name; pass a server URL with --url: {target}")
    bad = [u for u in urls if "://" not in u]
    if bad:
        raise ValueError(f"--url takes server URLs like http://10.0.0.5:8000, got {bad}")
    token = read_token_file(token_file) if token_file is not None else None
    if target is not None:
        return TargetClient(target, namespace=namespace, wait=wait, kubeconfig=kubeconfig, token=token)
    return TargetClient(list(urls), token=token)
