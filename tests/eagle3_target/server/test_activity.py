"""Who pulls from a server: data requests counted per client (our clients' header, else the peer host), the
most recent listed in /readyz, where the operator reads them without credentials; probes and /v1/info do
not count."""

from __future__ import annotations

import os
import socket
import time

import httpx
import pytest
from eagle3_target.client import TargetClient, identity
from eagle3_target.client.identity import client_id
from eagle3_target.protocol import CLIENT_HEADER, Activity
from eagle3_target.server.activity import MAX_CLIENTS, MAX_ID_LENGTH, MAX_LISTED, ActivityLog, client_of

from support.nemo_client import generate, loss_mask_for, nemo_session, set_mapping
from support.supervision import draft_mapping, supervise, token_batch


def activity(url: str) -> Activity:
    return Activity.model_validate(httpx.get(url + "/readyz").json()["activity"])


def by_id(seen: Activity) -> dict[str, int]:
    return {client.id: client.requests for client in seen.clients}


def test_data_requests_count_per_client_and_probes_do_not(server):
    before = activity(server.url)
    ids, mask, _ = token_batch(seed=21, batch=1, seq=8)
    tensors = {"input_ids": ids, "attention_mask": mask}
    for _ in range(2):
        supervise(httpx.Client(headers={CLIENT_HEADER: "trainer-a/1-aa"}), server.url, tensors)
    supervise(httpx.Client(headers={CLIENT_HEADER: "trainer-b/7-bb"}), server.url, tensors)
    for path in ("/readyz", "/healthz", "/v1/info", "/metrics"):
        httpx.get(server.url + path)
    after = activity(server.url)
    assert after.requests == before.requests + 3
    assert by_id(after)["trainer-a/1-aa"] == 2 and by_id(after)["trainer-b/7-bb"] == 1
    assert after.clients[0].id == "trainer-b/7-bb"  # the most recent first
    assert after.idle_seconds is not None and after.idle_seconds < 60
    assert before.idle_seconds is None or after.idle_seconds < before.idle_seconds
    assert after.in_flight == 0 and after.active_clients >= 2
    gauge = next(
        line
        for line in httpx.get(server.url + "/metrics").text.splitlines()
        if line.startswith("eagle3_active_clients ")
    )
    assert float(gauge.split()[1]) >= 2  # trainer-a and trainer-b, within the window


def test_target_client_names_its_process_and_nemo_counts_by_peer(server):
    with TargetClient(server.url) as client:
        ids, mask, _ = token_batch(seed=22, batch=1, seq=8)
        client.supervise(ids, mask)
    assert by_id(activity(server.url)).get(client_id(), 0) >= 1
    with nemo_session() as session:
        set_mapping(session, server.url, draft_mapping(16, seed=8))
        ids, mask, _ = token_batch(seed=23, batch=1, seq=6)
        assert generate(session, server.url, ids, mask, loss_mask_for(mask)).status_code == 200
    assert by_id(activity(server.url)).get("peer 127.0.0.1", 0) >= 1


def test_the_log_is_bounded_and_ids_are_cut():
    log = ActivityLog()
    for n in range(MAX_CLIENTS + 5):
        record(log, f"c{n}")
    seen = log.snapshot()
    assert seen.requests == MAX_CLIENTS + 5 and len(seen.clients) == MAX_LISTED
    assert seen.clients[0].id == f"c{MAX_CLIENTS + 4}"
    record(log, "c0")  # forgotten long ago: counted again from 1
    assert log.snapshot().clients[0].requests == 1
    assert client_of({CLIENT_HEADER: "x" * 1000}, "10.0.0.1") == "x" * MAX_ID_LENGTH
    assert client_of({}, "10.0.0.1") == "peer 10.0.0.1"


def record(log: ActivityLog, client: str) -> None:
    with log.request(client):
        pass


def test_a_request_is_in_flight_until_it_ends_and_its_end_is_the_last_activity():
    log = ActivityLog()
    with log.request("a"):
        time.sleep(0.5)
        during = log.snapshot()
    after = log.snapshot()
    assert during.in_flight == 1 and after.in_flight == 0
    assert during.idle_seconds is not None and after.idle_seconds is not None
    assert after.idle_seconds < 0.5 <= during.idle_seconds  # the end counts: the age starts again
    with pytest.raises(RuntimeError), log.request("b"):
        raise RuntimeError("a failed request still ends")
    assert log.snapshot().in_flight == 0 and log.active() == 2
    assert log.active(window=0) == 0


def test_ages_do_not_follow_the_wall_clock(monkeypatch):
    """A wall clock set back (or a node's skew) cannot age a request: ages come from the monotonic clock."""
    log = ActivityLog()
    record(log, "a")
    monkeypatch.setattr(time, "time", lambda: 0.0)  # 1970: a clock set back decades
    seen = log.snapshot()
    assert seen.idle_seconds is not None and 0 <= seen.idle_seconds < 5
    assert 0 <= seen.clients[0].idle_seconds < 5 and seen.active_clients == 1


def test_without_identities_only_counts_and_ages_are_shown():
    log = ActivityLog()
    record(log, "trainer-a/1")
    record(log, "trainer-b/2")
    hidden = log.snapshot(identities=False)
    assert hidden.clients == () and hidden.active_clients == 2 and hidden.requests == 2
    assert hidden.idle_seconds is not None


@pytest.mark.parametrize("name", ["", "job-7"])
def test_a_process_is_named_by_where_it_runs_and_its_pid(monkeypatch, name):
    identity._client_id.cache_clear()
    monkeypatch.setenv("EAGLE3_TARGET_CLIENT", name)
    where, process = client_id().split("/")
    assert where == (name or socket.gethostname())
    assert process.startswith(f"{os.getpid()}-") and client_id() == client_id()
    identity._client_id.cache_clear()
