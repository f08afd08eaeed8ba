"""`eagle3-operator` as a real subprocess against a cluster, for the operator tests, the chart test and the
scale benchmark."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx

from support.cluster.processes import kill_when_parent_dies, terminate
from support.cluster.waiting import LOOPBACK, eventually, free_port
from support.server_process import status_code


class OperatorProcess:
    """`eagle3-operator` as a subprocess: startable, killable (SIGKILL) and restartable, with its metrics.
    The kernel kills it if the test process dies without stopping it."""

    def __init__(
        self,
        kubeconfig: Path,
        log_dir: Path,
        namespaces: Sequence[str],
        reprobe_seconds: float | None = 1.0,
        extra_args: Sequence[str] = (),
        name: str = "operator",
    ) -> None:
        self.kubeconfig = kubeconfig
        self.log_dir = log_dir
        self.namespaces = list(namespaces)
        self.reprobe_seconds = reprobe_seconds
        self.extra_args = list(extra_args)  # read at each start: change them between a stop and a start
        self.name = name
        self.process: subprocess.Popen[bytes] | None = None
        self.metrics_port = 0
        self.liveness_port = 0
        self.readiness_port = 0
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}-{self.starts}.log"

    @staticmethod
    def command() -> list[str]:
        """How to run `eagle3-operator` from this Python environment."""
        exe = shutil.which("eagle3-operator", path=str(Path(sys.executable).parent))
        return [exe] if exe else [sys.executable, "-c", "from eagle3_operator.cli import main; main()"]

    def environment(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "NO_PROXY": "*"}

    def start(self) -> None:
        self.starts += 1
        self.metrics_port, self.liveness_port, self.readiness_port = free_port(), free_port(), free_port()
        argv = [
            *self.command(),
            *(f"--namespace={namespace}" for namespace in self.namespaces),
            f"--liveness=http://{LOOPBACK}:{self.liveness_port}/healthz",
            f"--readiness=http://{LOOPBACK}:{self.readiness_port}/readyz",
            f"--metrics-port={self.metrics_port}",
            f"--metrics-address={LOOPBACK}",
            *([] if self.reprobe_seconds is None else [f"--reprobe-seconds={self.reprobe_seconds}"]),
            "--api-timeout-seconds=10",
            *self.extra_args,
        ]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                preexec_fn=kill_when_parent_dies,
            )
        eventually(self._alive, "the operator's liveness endpoint", timeout=60)

    def _alive(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            raise AssertionError(f"operator exited:\n{self.log()[-4000:]}")
        return status_code(f"http://{LOOPBACK}:{self.liveness_port}/healthz") == 200

    def readiness(self) -> tuple[int, dict[str, bool]]:
        """The readiness endpoint's status code and body (readiness.py)."""
        response = httpx.get(f"http://{LOOPBACK}:{self.readiness_port}/readyz", timeout=5)
        return response.status_code, response.json()

    def kill(self) -> None:
        """SIGKILL: no cleanup at all, as when a node dies under the operator."""
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None:
            terminate(self.process)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def peak_rss_bytes(self) -> int:
        """The process's peak resident memory so far (VmHWM)."""
        assert self.process is not None
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        peak = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
        assert peak is not None, status
        return int(peak.group(1)) * 1024

    def metric_total(self, name: str) -> float:
        """The sum of a metric's samples over all label values."""
        text = httpx.get(f"http://{LOOPBACK}:{self.metrics_port}/metrics", timeout=5).text
        return sum(
            float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
        )

    def metric(self, name: str, **labels: str) -> float:
        """One sample from the operator's /metrics (0 when absent)."""
        text = httpx.get(f"http://{LOOPBACK}:{self.metrics_port}/metrics", timeout=5).text
        wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
        pattern = re.escape(name) + (r"\{" + re.escape(wanted) + r"\}" if labels else "") + r" (\S+)"
        match = re.search(rf"^{pattern}$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0
