"""Session-wide test setup: tiny random-weight models written once (no hub access), the vLLM stand-in and a
capture directory for the tests of the vLLM runner and of the stand-in itself, the local control plane
(started once, only if a test asks for it) with the Eagle3Target CRD, a fresh namespace per test, and a
guard that fails any run in which a test was skipped: CI is green only when every test ran and passed."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import kubernetes
import pytest
from eagle3_target.tiny import write_tiny_model

from support import fake_vllm as stand_in
from support.cluster import plane
from support.cluster.access import Cluster
from support.cluster.processes import log_tail
from support.crd import install_crd
from support.server_farm import ServerFarm
from support.server_process import AUTH_TOKEN

NOT_RUN_OUTCOMES = ("skipped", "xfailed", "xpassed")
LOG_TAIL_LINES = 10
_log_dirs: list[Path] = []  # where the logs of the plane this session used are, for the failure summary
_cluster_tests: set[str] = set()  # node ids of the tests that use the cluster


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that use the cluster carry the `cluster` marker, so `-m "not cluster"` leaves them out."""
    for item in items:
        if "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)
            _cluster_tests.add(item.nodeid)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The control plane: $E3T_KUBECONFIG's cluster if set, else the one `python -m support.cluster up`
    left running, else a private one that lives as long as this session."""
    external = os.environ.get("E3T_KUBECONFIG")
    if external:
        yield Cluster(Path(external))
        return
    running = plane.find_running()
    if running is not None:
        _log_dirs.append(running.directory)
        yield running.cluster()
        return
    directory = tmp_path_factory.mktemp("cluster")
    _log_dirs.append(directory)
    own = plane.start(directory, detached=False)
    try:
        yield own.cluster()
    finally:
        own.stop()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama-style, untied lm_head, 8 layers, hidden 64, vocab 256, fp32, stored in several shards."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", max_shard_size="200KB")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-style, tied embeddings, 8 layers, hidden 64, vocab 256, fp32, one safetensors file."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), arch="qwen3")


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """`vllm` is the stand-in for the duration of the test (the runner imports it lazily)."""
    stand_in.install(monkeypatch)
    return stand_in


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    """Stands in for /dev/shm: the runner's capture files must all be gone after each call."""
    path = tmp_path / "shm"
    path.mkdir()
    return path


@pytest.fixture(scope="session")
def servers(tiny_llama_dir: Path) -> Iterator[ServerFarm]:
    """One target server (the tiny Llama) that answers at any pod IP:port it is bound to."""
    farm = ServerFarm(tiny_llama_dir)
    try:
        yield farm
    finally:
        farm.close()


@pytest.fixture(scope="session")
def auth_servers(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerFarm]:
    """A target server that wants a bearer token (spec.auth) on everything but the health routes."""
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(f"{AUTH_TOKEN}\n")
    farm = ServerFarm(tiny_llama_dir, auth_token_file=token_file)
    try:
        yield farm
    finally:
        farm.close()


@pytest.fixture(scope="module")
def crd(cluster: Cluster) -> None:
    """The Eagle3Target CRD of this checkout, installed (or updated) and Established."""
    install_crd(cluster)


@pytest.fixture
def make_namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Callable[[str], str]]:
    """Creates namespaces named `<prefix><test name>-<random>`; all are deleted afterwards (their pods go
    with them)."""
    core = kubernetes.client.CoreV1Api(cluster.api_client)
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    created: list[str] = []

    def make(prefix: str = "") -> str:
        name = f"{prefix}{slug}-{secrets.token_hex(3)}"
        core.create_namespace(
            kubernetes.client.V1Namespace(metadata=kubernetes.client.V1ObjectMeta(name=name))
        )
        created.append(name)
        return name

    yield make
    for name in created:
        core.delete_namespace(name)


@pytest.fixture
def namespace(make_namespace: Callable[[str], str]) -> str:
    """A namespace named after the test, deleted afterwards."""
    return make_namespace("")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """After a failed cluster test, show where the control plane's logs are and how they end (CI keeps only
    the console)."""
    failed = terminalreporter.stats.get("failed", []) + terminalreporter.stats.get("error", [])
    if _log_dirs and any(report.nodeid in _cluster_tests for report in failed):
        terminalreporter.write_sep("=", "control plane logs")
        for directory in _log_dirs:
            for log in sorted(directory.glob("*.log")):
                terminalreporter.write_line(f"--- {log} (last {LOG_TAIL_LINES} lines)")
                terminalreporter.write_line(log_tail(log, LOG_TAIL_LINES))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A skipped (or xfailed) test fails the run: CI must never be green by not running something."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    not_run = {
        outcome: len(reporter.stats[outcome]) for outcome in NOT_RUN_OUTCOMES if reporter.stats.get(outcome)
    }
    if not_run:
        reporter.ensure_newline()
        reporter.write_sep("=", f"FAILED: tests that did not run count as failures: {not_run}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
