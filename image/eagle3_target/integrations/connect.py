"""Where a served target is and how to reach it, from what a user types: a resource name (resolved and
followed) or server URLs, and an optional bearer-token file (handed to the client as a file, which it reads
again after a Secret's rotation). The exporters build one `Connection` from their shared options, the
speculators backend from its flags; every process opens its own client from it.

Torch-free (the client is imported when a connection opens), so the command line starts quickly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eagle3_target.client.target_client import TargetClient


@dataclass(frozen=True)
class Connection:
    """The `Eagle3Target` named `target`, or the servers at `urls`: exactly one of them (checked on `open`).
    Plain values only, so it pickles into data-loader workers."""

    target: str | None = None
    urls: tuple[str, ...] = ()
    namespace: str | None = None
    token_file: Path | None = None
    wait: float = 300.0  # seconds to wait for a named target to be Available (some endpoint serves)
    kubeconfig: str | None = None

    def open(self) -> TargetClient:
        """A client of the target; ValueError for a name given as a URL, a URL without a scheme, or neither
        or both given."""
        from eagle3_target.client.target_client import TargetClient

        if (self.target is None) == (not self.urls):
            raise ValueError("give either a target name (--target) or its server URLs (--url), not both")
        if self.target is not None and "://" in self.target:
            raise ValueError(
                f"--target takes an Eagle3Target name; pass a server URL with --url: {self.target}"
            )
        bad = [u for u in self.urls if "://" not in u]
        if bad:
            raise ValueError(f"--url takes server URLs like http://10.0.0.5:8000, got {bad}")
        if self.target is not None:
            return TargetClient(
                self.target,
                namespace=self.namespace,
                wait=self.wait,
                kubeconfig=self.kubeconfig,
                token_file=self.token_file,
            )
        return TargetClient(list(self.urls), token_file=self.token_file)
