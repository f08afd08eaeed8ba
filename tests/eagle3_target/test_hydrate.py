"""`eagle3-target hydrate`: one download per model, a marker written only after every file is whole, progress
while it runs, and a failure's reason in the termination log with an exit code that says whether to retry.

The Hub cannot be reached here, so the downloads are a stand-in with snapshot_download's keyword signature
and dry-run answer (huggingface_hub's own DryRunFileInfo); the command line runs the real snapshot_download
against a closed loopback port.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from eagle3_target.hydrate import (
    EXIT_PERMANENT,
    HYDRATION_MARKER,
    HydrationFailed,
    ProgressTracker,
    hydrate,
    serve_progress,
)
from eagle3_target.protocol import HydrationProgress
from huggingface_hub.errors import GatedRepoError, RevisionNotFoundError
from huggingface_hub.file_download import DryRunFileInfo

from support.cluster.waiting import LOOPBACK, free_port
from support.server_process import serve_command

FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"\x00" * 4096}


class FakeHub:
    """snapshot_download for one repository: a dry run lists FILES, a real run writes them (or fewer bytes,
    or raises `error`), recording each call."""

    def __init__(self, *, error: Exception | None = None, truncate: str | None = None) -> None:
        self.error = error
        self.truncate = truncate
        self.calls: list[dict[str, Any]] = []

    def __call__(
        self,
        repo_id: str,
        *,
        revision: str,
        local_dir: Path,
        ignore_patterns: list[str] | None,
        dry_run: bool = False,
    ) -> Any:
        self.calls.append({"repo": repo_id, "revision": revision, "dry_run": dry_run})
        if self.error is not None:
            raise self.error
        if dry_run:
            return [
                DryRunFileInfo("c0ffee", len(data), name, str(local_dir / name), False, True)
                for name, data in FILES.items()
            ]
        for name, data in FILES.items():
            (local_dir / name).write_bytes(data[:-1] if name == self.truncate else data)
        return str(local_dir)


def test_downloads_once_and_marks_completion_last(tmp_path: Path):
    hub = FakeHub()
    tracker = ProgressTracker(tmp_path)
    marker = hydrate("org/tiny", "main", tmp_path, excludes=["original/*"], tracker=tracker, download=hub)
    assert [call["dry_run"] for call in hub.calls] == [True, False]
    assert marker["commit"] == "c0ffee" and marker["files"] == 2
    assert marker["bytes"] == sum(len(data) for data in FILES.values())
    assert json.loads((tmp_path / HYDRATION_MARKER).read_text()) == marker
    assert tracker.measure() == HydrationProgress(
        files_done=2, files_total=2, bytes_done=marker["bytes"], bytes_total=marker["bytes"]
    )
    again = hydrate("org/tiny", "main", tmp_path, excludes=[], download=hub)
    assert again == marker and len(hub.calls) == 2  # the marker is there: nothing is fetched again


def test_a_short_file_leaves_no_marker(tmp_path: Path):
    with pytest.raises(HydrationFailed, match="1 files missing or of the wrong size") as caught:
        hydrate("org/tiny", "main", tmp_path, excludes=[], download=FakeHub(truncate="model.safetensors"))
    assert caught.value.exit_code == 1  # a retry may fix it
    assert not (tmp_path / HYDRATION_MARKER).exists()


def _response(status: int) -> httpx.Response:
    return httpx.Response(status, request=httpx.Request("GET", "https://huggingface.co/api/models/org/tiny"))


@pytest.mark.parametrize(
    ("error", "message", "exit_code"),
    [
        (GatedRepoError("Access to model org/tiny is restricted.", response=_response(401)), "gated", 2),
        (RevisionNotFoundError("Invalid rev id: v9", response=_response(404)), "revision not found", 2),
        (ConnectionError("Connection refused"), "ConnectionError: Connection refused", 1),
        (OSError(28, "No space left on device"), "cannot write the cache volume", 1),
    ],
)
def test_failures_name_their_reason_and_whether_to_retry(tmp_path: Path, error, message, exit_code):
    with pytest.raises(HydrationFailed) as caught:
        hydrate("org/tiny", "v9", tmp_path, excludes=[], download=FakeHub(error=error))
    assert message in str(caught.value) and str(caught.value).startswith("org/tiny@v9: ")
    assert caught.value.exit_code == exit_code
    assert not (tmp_path / HYDRATION_MARKER).exists()


def test_progress_counts_whole_files_and_partial_bytes(tmp_path: Path):
    tracker = ProgressTracker(tmp_path)
    assert tracker.measure() == HydrationProgress()  # nothing planned yet: nothing known
    tracker.plan([("config.json", 10), ("model.safetensors", 1000)])
    (tmp_path / "config.json").write_bytes(b"x" * 10)
    partial = tmp_path / ".cache" / "huggingface" / "download"
    partial.mkdir(parents=True)
    (partial / "abc.incomplete").write_bytes(b"x" * 300)
    server = serve_progress(tracker, port := free_port())
    try:
        answer = httpx.get(f"http://{LOOPBACK}:{port}/", timeout=5).json()
    finally:
        server.shutdown()
    assert answer == {"filesDone": 1, "filesTotal": 2, "bytesDone": 310, "bytesTotal": 1010}


def test_the_server_pods_wait_until_the_marker_is_there(tmp_path: Path):
    """`eagle3-target wait-for-model` as the init container runs it: blocked without the marker, then done."""
    waiting = subprocess.Popen(
        [*serve_command(), "wait-for-model", "--local-dir", str(tmp_path), "--poll-seconds", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(timeout=5)  # a half-filled directory (no marker) keeps it waiting
        hydrate("org/tiny", "main", tmp_path, excludes=[], download=FakeHub())
        assert waiting.wait(timeout=30) == 0
    finally:
        waiting.kill()
    assert f"waiting for {tmp_path / HYDRATION_MARKER}" in waiting.stderr.read()


def test_the_command_reports_an_unreachable_hub_in_the_termination_log(tmp_path: Path):
    """The real snapshot_download, pointed at a closed loopback port: exit 1 (worth a retry), the reason in
    the termination log, no marker."""
    termination_log = tmp_path / "termination-log"
    env = {**os.environ, "HF_ENDPOINT": f"http://{LOOPBACK}:{free_port()}", "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    args = ["--repo", "org/tiny", "--revision", "main", "--local-dir", str(tmp_path / "cache")]
    result = subprocess.run(
        [*serve_command(), "hydrate", *args, "--termination-log", str(termination_log)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    reason = termination_log.read_text()
    assert reason.startswith("org/tiny@main: ") and reason in result.stderr
    assert not (tmp_path / "cache" / HYDRATION_MARKER).exists()
    assert EXIT_PERMANENT == 2
