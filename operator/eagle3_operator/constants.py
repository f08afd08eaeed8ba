"""Names the operator's modules share: the labels on its children and the child kinds it owns.

The Eagle3Target resource's own names (group, version, plural, field manager) are shared with the server
and the client, so they live in `eagle3_target.protocol`.
"""

from dataclasses import dataclass

from eagle3_target.protocol import FIELD_MANAGER

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
APP_NAME = "eagle3-target"
COMPONENT = "target-server"
# The containers of a target pod: the server, and for Hugging Face sources the init container that downloads.
SERVER_CONTAINER = "server"
DOWNLOAD_CONTAINER = "download-model"
# The label every child carries; the watches select on it, so memory does not grow with the cluster.
MANAGED_LABELS = {LABEL_MANAGED_BY: FIELD_MANAGER}


@dataclass(frozen=True)
class ChildKind:
    """One kind of object the operator creates for a target."""

    api_version: str
    kind: str
    plural: str
    # Watched kinds have a kopf index; an unwatched kind's CRD may not even exist, so it is not watched.
    watched: bool = True

    @property
    def selector(self) -> tuple[str, ...]:
        """kopf's resource selector: (group, version, plural), or (version, plural) for the core group."""
        return (*self.api_version.split("/"), self.plural)


# prometheus-operator's API, served only where its CRDs are installed.
POD_MONITOR_API_VERSION = "monitoring.coreos.com/v1"
CHILD_KINDS = (
    ChildKind("apps/v1", "Deployment", "deployments"),
    ChildKind("v1", "Service", "services"),
    ChildKind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
    ChildKind(POD_MONITOR_API_VERSION, "PodMonitor", "podmonitors", watched=False),
)
WATCHED_CHILD_KINDS = tuple(child for child in CHILD_KINDS if child.watched)
# The targets' pods are watched too (selected by the same label), though the Deployments own them.
POD_SELECTOR = ("v1", "pods")
