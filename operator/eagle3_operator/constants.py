"""Names the operator's modules share: the labels and annotations on its children, the child kinds it owns
and the server pod's layout (which the spec's own pod settings must stay clear of).

The Eagle3Target resource's own names (group, version, plural, field manager) are shared with the server
and the client, so they live in `eagle3_target.protocol`.
"""

from dataclasses import dataclass

from eagle3_target.protocol import FIELD_MANAGER, GROUP

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
APP_NAME = "eagle3-target"
COMPONENT = "target-server"
# The containers of a target pod: the server, and for Hugging Face sources the init container that waits
# for the model; and the container of the hydration Job that downloads it.
SERVER_CONTAINER = "server"
WAIT_CONTAINER = "wait-for-model"
DOWNLOAD_CONTAINER = "download-model"
# The hydration Job's pods: its component label tells them from the server pods (they carry no name label,
# so no Service, Deployment, budget or NetworkPolicy selects them); the port their progress is served on.
HYDRATION_COMPONENT = "model-hydration"
HYDRATION_PROGRESS_PORT = 8090
# The label every child carries; the watches select on it, so memory does not grow with the cluster.
MANAGED_LABELS = {LABEL_MANAGED_BY: FIELD_MANAGER}

# On every child: the digest of what the operator rendered for it. A child is applied when its stamp
# differs from the rendering (so a field removed from the spec is pruned by server-side apply) or when
# someone else changed what it renders (drift).
ANNOTATION_RENDERED_DIGEST = f"{GROUP}/rendered-digest"
# On a Deployment: the server image its target runs when spec.image is unset, fixed when the Deployment is
# first rendered, so upgrading the operator restarts no target.
ANNOTATION_SERVER_IMAGE = f"{GROUP}/server-image"
# Beside it, when not the default: the image's variant (which engines it has), so moving the target to an
# engine of another variant moves it to that variant's image.
ANNOTATION_SERVER_IMAGE_VARIANT = f"{GROUP}/server-image-variant"
# On a target: set or change its value to move the target to the operator's current server image (the
# Deployment records the value it acted on).
ANNOTATION_UPGRADE = f"{GROUP}/upgrade-server-image"
# On the CRD: the version of its schema. The operator refuses to start on a CRD older than the one it
# needs (crds/ holds the matching CRD); a newer one is fine (unknown fields are ignored with a warning).
ANNOTATION_SCHEMA_VERSION = f"{GROUP}/schema-version"
CRD_SCHEMA_VERSION = 1
# The server pod's layout: what the operator itself puts there, so the spec's own pod settings cannot
# collide with it (the CRD refuses the same names; tests keep the two lists in step).
MODEL_MOUNT = "/models"
SHM_MOUNT = "/dev/shm"
AUTH_MOUNT = "/var/run/secrets/eagle3-target/auth"
# The root filesystem is read-only: HOME and TMPDIR point into this emptyDir (engines' compile caches,
# vLLM's IPC sockets, the Hub client's locks), the one place a target's containers write besides /dev/shm.
SCRATCH_MOUNT = "/var/lib/eagle3-target"
OPERATOR_VOLUMES = frozenset({"model", "dshm", "auth", "scratch"})
OPERATOR_MOUNT_PATHS = (MODEL_MOUNT, SHM_MOUNT, AUTH_MOUNT, SCRATCH_MOUNT)
# Environment the server container gets from the operator: the Hub switch and every EAGLE3_TARGET_* setting
# the command line already sets from a typed field (flags win over env, so such an entry would be ignored).
OPERATOR_ENV_PREFIX = "EAGLE3_TARGET_"
OPERATOR_ENV = frozenset(
    {
        "HF_HUB_OFFLINE",
        *(
            f"{OPERATOR_ENV_PREFIX}{name}"
            for name in (
                "MODEL",
                "ENGINE",
                "HOST",
                "PORT",
                "METRICS_PORT",
                "MODEL_NAME",
                "REVISION",
                "DTYPE",
                "AUX_LAYER_IDS",
                "CAPTURE_LAYER_IDS",
                "TENSOR_PARALLEL_SIZE",
                "MAX_MODEL_LEN",
                "ENGINE_ARGS",
                "AUTH_TOKEN_FILE",
                "TRUST_REMOTE_CODE",
            )
        ),
    }
)
# Environment of the hydration Job's download that only the operator sets: the Hub token (from the source's
# tokenSecretRef), the cache location, the Hub switch, HOME and TMPDIR (the scratch volume: elsewhere the
# download cannot write under a read-only root), and (by OPERATOR_ENV_PREFIX) the CLI's own settings.
# HF_HUB_DISABLE_TELEMETRY stays the author's: turned back on it only pings the Hub, carrying no credential.
HYDRATION_ENV = frozenset({"HF_TOKEN", "HF_HOME", "HF_HUB_OFFLINE", "HOME", "TMPDIR"})
# Pod label keys the operator sets: two select the pods (a Deployment's selector is immutable), the managed-by
# label is what the operator's pod watch selects on.
OPERATOR_LABEL_KEYS = (LABEL_NAME, LABEL_INSTANCE, LABEL_COMPONENT, LABEL_MANAGED_BY)
DEFAULT_CONTAINER_ANNOTATION = "kubectl.kubernetes.io/default-container"


@dataclass(frozen=True)
class ChildKind:
    """One kind of object the operator creates for a target."""

    api_version: str
    kind: str
    plural: str
    # Watched kinds have a kopf index; an unwatched kind's CRD may not even exist, so it is not watched.
    watched: bool = True

    @property
    def selector(self) -> tuple[str, str] | tuple[str, str, str]:
        """kopf's resource selector: (group, version, plural), or (version, plural) for the core group."""
        group, _, version = self.api_version.rpartition("/")
        return (group, version, self.plural) if group else (version, self.plural)


# prometheus-operator's API, served only where its CRDs are installed.
POD_MONITOR_API_VERSION = "monitoring.coreos.com/v1"
CHILD_KINDS = (
    ChildKind("apps/v1", "Deployment", "deployments"),
    ChildKind("v1", "Service", "services"),
    ChildKind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
    ChildKind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
    ChildKind("batch/v1", "Job", "jobs"),
    ChildKind(POD_MONITOR_API_VERSION, "PodMonitor", "podmonitors", watched=False),
)
WATCHED_CHILD_KINDS = tuple(child for child in CHILD_KINDS if child.watched)
# The targets' pods are watched too (selected by the same label), though the Deployments own them.
POD_SELECTOR: tuple[str, str] = ("v1", "pods")
