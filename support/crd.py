"""The Eagle3Target CRD from this repository, read and installed the one way every test and benchmark does."""

from __future__ import annotations

from typing import Any

import yaml
from eagle3_target.protocol import GROUP, PLURAL

from support.cluster.access import REPO, Cluster

CRD_FILE = REPO / "crds" / f"{PLURAL}.{GROUP}.yaml"


def crd_manifest() -> dict[str, Any]:
    return yaml.safe_load(CRD_FILE.read_text())


def install_crd(cluster: Cluster) -> None:
    """Server-side apply (so a changed CRD replaces an older one left on a reused plane), then wait until it
    is Established."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{PLURAL}.{GROUP}")
