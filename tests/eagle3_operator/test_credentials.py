"""No credential leaves the operator: it probes an author's own endpoint without any Secret, and sees
token-protected pods serve without reading their token.

One operator process serves the whole module (only this module's namespaces); each test has its own.
"""

from __future__ import annotations

import http.server
import json
import secrets
import threading
from typing import Any

import httpx
import pytest

from support.cluster.access import Cluster
from support.cluster.waiting import eventually, free_port
from support.server_farm import PodServing, ServerFarm
from support.targets import Targets, target_manifest

pytestmark = pytest.mark.usefixtures("operator")


class RecordingServer:
    """An external endpoint that answers like a target server (the farm's real /v1/info) and records every
    request's headers: what a resource author who points spec.endpoint.url at their own host would see."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.requests: list[tuple[str, dict[str, str]]] = []
        recorded, body = self.requests, json.dumps(info).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                recorded.append((self.path, dict(self.headers)))
                payload = body if self.path == "/v1/info" else b'{"status": "ready"}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_no_secret_leaves_through_a_spec(targets: Targets, servers: ServerFarm):
    """A resource author names someone else's Secret in spec.auth and points spec.endpoint.url at their own
    server: the operator probes it (and reports it Ready) without sending any credential at all."""
    secret_value = f"do-not-leak-{secrets.token_hex(8)}"
    victim = {"metadata": {"name": "victim"}, "stringData": {"token": secret_value}}
    targets.core.create_namespaced_secret(targets.namespace, victim)
    recorder = RecordingServer(servers.info())
    try:
        manifest = target_manifest("deputy", 8000)
        manifest["spec"] = {
            "model": {"name": "tiny-llama"},
            "engine": "hf",
            "endpoint": {"url": recorder.url},
            "auth": {"tokenSecretRef": {"name": "victim"}},
        }
        targets.create(manifest)
        status = eventually(lambda: targets.ready_status("deputy"), "the external target Ready")
        assert status["model"]["name"] == "tiny-llama"
        paths = {path for path, _ in recorder.requests}
        assert {"/readyz", "/v1/info"} <= paths
        for _, headers in recorder.requests:
            assert "authorization" not in {key.lower() for key in headers}
            assert not any(secret_value in value for value in headers.values())
    finally:
        recorder.close()


def test_token_protected_pods_are_probed_without_their_token(
    targets: Targets, auth_servers: ServerFarm, cluster: Cluster
):
    """spec.auth on managed pods: the servers want the token on the data routes, the operator never reads it
    and still sees them serve (/readyz and /v1/info are open)."""
    with PodServing(targets.core, targets.namespace, auth_servers) as serving:
        port = free_port()
        serving.ports.add(port)
        token = {"metadata": {"name": "target-token"}, "stringData": {"token": "not-for-the-operator"}}
        targets.core.create_namespaced_secret(targets.namespace, token)
        targets.create(target_manifest("guarded", port, auth={"tokenSecretRef": {"name": "target-token"}}))
        status = eventually(lambda: targets.ready_status("guarded", replicas=1), "Ready without the Secret")
        address = status["endpoints"][0]["address"]
        assert httpx.get(f"{address}/v1/weights/lm_head", timeout=5).status_code == 401
