"""The operator's tunables and how they map onto kopf's settings."""

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import kopf
from eagle3_target.protocol import FIELD_MANAGER, GROUP
from pydantic import TypeAdapter, ValidationError

from eagle3_operator.constants import MANAGED_LABELS, POD_SELECTOR, WATCHED_CHILD_KINDS
from eagle3_operator.render.network import Neighbours
from eagle3_operator.render.server_image import DEFAULT_IMAGES, ServerImages
from eagle3_operator.spec_pod_settings import Labels

# Project-prefixed names, so kopf's markers (should any ever be written) are recognisably ours.
PERSISTENCE_PREFIX = GROUP
# Only the operator's own children are watched: the API server filters, so memory does not grow with
# every pod in the cluster.
CHILD_SELECTOR = ",".join(f"{key}={value}" for key, value in MANAGED_LABELS.items())
# The characters that make a kopf namespace pattern more than one exact name: globs, negation, lists.
NAMESPACE_PATTERN_CHARACTERS = frozenset("*?!,")


@dataclass(frozen=True)
class OperatorConfig:
    reprobe_seconds: float = 10.0  # how often each target-server endpoint is probed
    server_images: ServerImages = DEFAULT_IMAGES  # what new targets without spec.image run, per variant
    api_timeout_seconds: float = 15.0  # one API request, reconciler and kopf alike
    watch_timeout_seconds: int = 300  # a watch request is renewed at least this often (the API wants an int)
    # kopf's cluster scanning: watch Namespaces (to match patterns) and CRDs (to notice new kinds). Off for a
    # list of exact namespaces, which kopf then serves as given, needing no cluster-wide reads.
    scan_cluster: bool = True
    # What the targets' NetworkPolicies admit and their PodMonitors are labelled with.
    neighbours: Neighbours = Neighbours()


_LABELS = TypeAdapter(Labels)


def parse_labels(pairs: Iterable[str]) -> dict[str, str]:
    """KEY=VALUE labels (--pod-monitor-label), checked as a spec's labels are; ValueError naming the first
    that is not a label."""
    labels: dict[str, str] = {}
    for pair in pairs:
        key, equals, value = pair.partition("=")
        if not equals:
            raise ValueError(f"{pair!r} is not KEY=VALUE, e.g. release=kube-prometheus-stack")
        try:
            labels |= _LABELS.validate_python({key: value})
        except ValidationError as error:
            (first, *_) = error.errors()
            raise ValueError(f"{pair!r}: {first.get('ctx', {}).get('error', first['msg'])}") from None
    return labels


def needs_cluster_scanning(namespaces: Iterable[str]) -> bool:
    """Whether kopf must watch Namespaces (and CRDs): only to match namespace patterns.

    Cluster-wide, kopf watches every namespace with one watch per kind and needs no Namespace list; the
    CRD exists before the operator starts (it checks), so watching all CRDs, which can be a large read in
    CRD-heavy clusters, buys nothing. kopf's namespace watch drops namespaces created between its initial
    listing and its watch (it lists again and ignores what that listing returns), so a namespace matching
    a pattern created then stays unserved until it changes or the operator restarts.
    """
    return any(NAMESPACE_PATTERN_CHARACTERS & set(namespace) for namespace in namespaces)


def configure(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    settings.scanning.disabled = not config.scan_cluster
    settings.networking.request_timeout = config.api_timeout_seconds
    settings.networking.connect_timeout = min(10.0, config.api_timeout_seconds)
    settings.watching.server_timeout = config.watch_timeout_seconds
    settings.watching.client_timeout = config.watch_timeout_seconds + 30
    settings.watching.connect_timeout = 10.0
    for selector in (POD_SELECTOR, *(child.selector for child in WATCHED_CHILD_KINDS)):
        settings.watching.label_selectors[selector] = CHILD_SELECTOR
    settings.persistence.finalizer = f"{PERSISTENCE_PREFIX}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PERSISTENCE_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=PERSISTENCE_PREFIX)
    # The reconciler posts its own, deduplicated events on transitions; log lines stay in the log.
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = FIELD_MANAGER
