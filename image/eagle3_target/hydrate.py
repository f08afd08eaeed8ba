"""`eagle3-target hydrate`: fill a model cache directory from the Hugging Face Hub once, for every replica.

The operator runs this as one Job per (repository, revision, cache claim), so replicas never download the
same files into the shared cache at once. The completion marker (HYDRATION_MARKER) is written
last and atomically: a directory with the marker holds the whole snapshot, and server pods wait for it, so a
half-downloaded model is never served. While the download runs, GET on `--progress-port` answers the files
and bytes done (`protocol.HydrationProgress`); a failure ends with its reason in the termination message,
and with exit code 2 when retrying cannot help (no such repository or revision, no access).
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from eagle3_target.protocol import HydrationProgress

# Written into the snapshot directory once every file is whole; `wait-for-model` (the server pods' init
# container) returns only when it is there.
HYDRATION_MARKER = ".eagle3-hydrated.json"
EXIT_TRANSIENT = 1
EXIT_PERMANENT = 2
# Where huggingface_hub keeps partial downloads inside a local_dir.
_INCOMPLETE_DIR = Path(".cache") / "huggingface" / "download"
# The cache volume's problems (full, read-only, not ours) rather than the network's.
_DISK_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})

Download = Callable[..., Any]  # huggingface_hub.snapshot_download's signature


class HydrationFailed(Exception):
    """The download failed; `exit_code` says whether a retry can help."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def marker_path(local_dir: Path) -> Path:
    return local_dir / HYDRATION_MARKER


def is_hydrated(local_dir: Path) -> bool:
    return marker_path(local_dir).is_file()


def wait_until_hydrated(local_dir: Path, poll_seconds: float, say: Callable[[str], None]) -> None:
    """Block until the marker is there, saying once what it waits for."""
    if is_hydrated(local_dir):
        return
    say(f"waiting for {marker_path(local_dir)} (the hydration Job writes it once the snapshot is whole)")
    while not is_hydrated(local_dir):
        time.sleep(poll_seconds)


class ProgressTracker:
    """Files and bytes of a planned snapshot already on disk, re-measured on every read."""

    def __init__(self, local_dir: Path) -> None:
        self.local_dir = local_dir
        self._planned: dict[str, int] = {}  # file name -> size, from the Hub's listing
        self._lock = threading.Lock()

    def plan(self, files: Iterable[tuple[str, int]]) -> None:
        with self._lock:
            self._planned = dict(files)

    def measure(self) -> HydrationProgress:
        with self._lock:
            planned = dict(self._planned)
        if not planned:
            return HydrationProgress()
        done = [name for name, size in planned.items() if _size(self.local_dir / name) == size]
        partial = sum(_size(path) or 0 for path in (self.local_dir / _INCOMPLETE_DIR).glob("*.incomplete"))
        return HydrationProgress(
            files_done=len(done),
            files_total=len(planned),
            bytes_done=sum(planned[name] for name in done) + partial,
            bytes_total=sum(planned.values()),
        )


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def hydrate(
    repo: str,
    revision: str,
    local_dir: Path,
    *,
    excludes: list[str],
    tracker: ProgressTracker | None = None,
    download: Download | None = None,
) -> dict[str, Any]:
    """Download the snapshot unless the marker is there; verify every file; then write the marker.

    Returns the marker's content. Raises HydrationFailed with a message for the termination log.
    """
    if is_hydrated(local_dir):
        return json.loads(marker_path(local_dir).read_text())
    fetch: Download
    if download is None:
        from huggingface_hub import snapshot_download

        fetch = snapshot_download
    else:
        fetch = download
    tracker = tracker or ProgressTracker(local_dir)
    where = f"{repo}@{revision}"
    options: dict[str, Any] = {
        "revision": revision,
        "local_dir": local_dir,
        "ignore_patterns": excludes or None,
    }
    try:
        planned = fetch(repo, dry_run=True, **options)
        tracker.plan((info.filename, info.file_size) for info in planned)
        fetch(repo, **options)
    except Exception as error:  # The Hub's errors, the network's and the disk's: each named for the user.
        raise _failure(where, error) from error
    progress = tracker.measure()
    done, total = progress.files_done or 0, progress.files_total or 0  # both set once a plan exists
    if done != total:
        missing = total - done
        raise HydrationFailed(f"{where}: {missing} files missing or of the wrong size after download", 1)
    marker = {
        "repo": repo,
        "revision": revision,
        "commit": next((info.commit_hash for info in planned), None),
        "files": progress.files_total,
        "bytes": progress.bytes_total,
        "finished": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    partial = marker_path(local_dir).with_suffix(".tmp")
    partial.write_text(json.dumps(marker, indent=2) + "\n")
    os.replace(partial, marker_path(local_dir))  # atomic: the marker is whole or absent
    return marker


def _failure(where: str, error: Exception) -> HydrationFailed:
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(error, GatedRepoError):
        return HydrationFailed(f"{where}: gated repository; the token may not read it: {first_line}", 2)
    if isinstance(error, RepositoryNotFoundError):
        return HydrationFailed(f"{where}: repository not found (or private without a token): {first_line}", 2)
    if isinstance(error, RevisionNotFoundError):
        return HydrationFailed(f"{where}: revision not found: {first_line}", 2)
    status = getattr(getattr(error, "response", None), "status_code", None)
    if isinstance(error, HfHubHTTPError) and status in (401, 403):
        return HydrationFailed(f"{where}: access denied ({status}): {first_line}", 2)
    if isinstance(error, OSError) and error.errno in _DISK_ERRORS:
        return HydrationFailed(f"{where}: cannot write the cache volume: {first_line}", 1)
    return HydrationFailed(f"{where}: {type(error).__name__}: {first_line}", 1)


def serve_progress(tracker: ProgressTracker, port: int) -> ThreadingHTTPServer:
    """GET (any path) answers the progress as JSON, from a daemon thread; the caller shuts it down."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = tracker.measure().model_dump_json(by_alias=True).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:  # one line per operator poll would drown the log
            return

    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="progress").start()
    return server
