"""The harness's own promises: it recognises its processes from a state file and never signals a stranger,
leaves nothing running (SIGKILL after a grace period, whole process groups, and the kernel's parent-death
signal when the test process itself is killed), and a failed start says which component failed and why."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.cluster import plane
from support.cluster.access import BIN_DIR
from support.cluster.processes import ClusterStartError, Process, log_tail, spawn, stop, wait_until
from support.cluster.waiting import eventually


def gone(pid: int) -> bool:
    """No such process, or only a zombie that nobody has reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def test_a_process_is_recognised_from_its_saved_state_and_a_reused_pid_is_not(tmp_path):
    sleeper = spawn("sleeper", ["sleep", "60"], tmp_path / "sleeper.log", die_with_parent=True)
    try:
        saved = Process.from_json(json.loads(json.dumps(sleeper.to_json())))
        assert saved.alive()
        assert not dataclasses.replace(saved, start_ticks=saved.start_ticks + 1).alive()
        stop([saved])  # as `down` does from another shell: no Popen, only the state
        assert sleeper.popen.wait(timeout=10) == -signal.SIGTERM
    finally:
        stop([sleeper])


def test_stop_kills_the_whole_group_of_a_process_that_ignores_sigterm(tmp_path):
    child_pid = tmp_path / "child.pid"
    script = f"trap '' TERM; sleep 60 & echo $! > {child_pid}; wait"
    stubborn = spawn("stubborn", ["sh", "-c", script], tmp_path / "stubborn.log", die_with_parent=True)
    pid = int(eventually(lambda: child_pid.exists() and child_pid.read_text().strip(), "the child's pid", 10))
    stop([stubborn], grace_seconds=0.5)
    assert stubborn.popen.returncode == -signal.SIGKILL
    eventually(lambda: gone(pid), "the grandchild to go with its group", 10)


def test_processes_die_with_the_test_process_that_started_them(tmp_path):
    starter = f"""
import sys, time
from pathlib import Path
from support.cluster.processes import spawn
log = Path({str(tmp_path / "sleeper.log")!r})
print(spawn("sleeper", ["sleep", "60"], log, die_with_parent=True).pid, flush=True)
time.sleep(60)
"""
    parent = subprocess.Popen(
        [sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True, cwd=plane.REPO
    )
    sleeper_pid = int(parent.stdout.readline())
    assert not gone(sleeper_pid)
    parent.kill()  # no cleanup code runs: only the kernel's parent-death signal can stop the sleeper
    parent.wait()
    eventually(lambda: gone(sleeper_pid), "the orphan to be killed", 10)


def test_log_tail_reads_the_end(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n" for i in range(1000)))
    assert log_tail(log, 3) == "line 997\nline 998\nline 999"
    assert "cannot read" in log_tail(tmp_path / "missing.log")


def test_waiting_fails_early_with_the_log_of_a_process_that_died(tmp_path):
    dying = spawn(
        "dying", ["sh", "-c", "echo cannot bind; exit 3"], tmp_path / "dying.log", die_with_parent=True
    )
    with pytest.raises(ClusterStartError, match=r"(?s)dying exited while waiting for readiness.*cannot bind"):
        wait_until(lambda: False, "readiness", 60, [dying])


def test_start_without_the_binaries_says_how_to_build_them(tmp_path):
    with pytest.raises(ClusterStartError, match="make tools"):
        plane.start(tmp_path / "cluster", detached=False, bin_dir=tmp_path / "empty")


def test_a_component_that_fails_to_start_is_named_and_nothing_is_left_running(tmp_path, monkeypatch):
    real_argv = plane.apiserver_argv
    monkeypatch.setattr(plane, "apiserver_argv", lambda *args: [*real_argv(*args), "--no-such-flag"])
    with pytest.raises(ClusterStartError, match=r"(?s)kube-apiserver exited.*unknown flag: --no-such-flag"):
        plane.start(tmp_path / "cluster", detached=False, bin_dir=BIN_DIR)
    state = tmp_path / "cluster" / "state.json"
    assert not state.exists()
    etcd_log = tmp_path / "cluster" / "etcd.log"
    assert etcd_log.exists()  # etcd had started, so it must have been stopped: find it by its data dir
    leftovers = subprocess.run(
        ["pgrep", "-f", str(tmp_path / "cluster")], capture_output=True, text=True
    ).stdout
    assert leftovers == ""
