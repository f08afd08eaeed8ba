"""The operator's tunables and how they map onto kopf's settings."""

import logging
from dataclasses import dataclass

import kopf

from eagle3_operator.render import LABEL_MANAGED_BY, MANAGER

# Project-prefixed names, so kopf's markers (should any ever be written) are recognisably ours.
PERSISTENCE_PREFIX = "eagle3.dev"
# Only the operator's own children are watched: the API server filters, so memory does not grow with
# every pod in the cluster.
CHILD_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGER}"
# The child kinds the operator creates and watches (by plural, as kopf resource selectors); plus their pods.
CHILD_RESOURCES = {
    "deployments": ("apps", "v1", "deployments"),
    "services": ("v1", "services"),
    "poddisruptionbudgets": ("policy", "v1", "poddisruptionbudgets"),
}
POD_RESOURCE = ("v1", "pods")


@dataclass(frozen=True)
class OperatorConfig:
    reprobe_seconds: float = 15.0  # how often targets with pods are re-probed for readiness changes
    api_timeout_seconds: float = 15.0  # one API request, reconciler and kopf alike
    watch_timeout_seconds: int = 300  # a watch request is renewed at least this often (the API wants an int)


def configure(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    settings.networking.request_timeout = config.api_timeout_seconds
    settings.networking.connect_timeout = min(10.0, config.api_timeout_seconds)
    settings.watching.server_timeout = config.watch_timeout_seconds
    settings.watching.client_timeout = config.watch_timeout_seconds + 30
    settings.watching.connect_timeout = 10.0
    for selector in (POD_RESOURCE, *CHILD_RESOURCES.values()):
        settings.watching.label_selectors[selector] = CHILD_SELECTOR
    settings.persistence.finalizer = f"{PERSISTENCE_PREFIX}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PERSISTENCE_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=PERSISTENCE_PREFIX)
    # The reconciler posts its own, deduplicated events on transitions; log lines stay in the log.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = MANAGER
