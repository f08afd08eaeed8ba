"""Readiness once the engine has died (`ServerState.require_target`): /readyz and every data route answer 503
with why, for good, and the server says why in its termination log and stops (the CLI then exits with
EXIT_ENGINE_FAILED, so Kubernetes restarts the pod). A batch's own error stays that batch's (500) and the
server serves on. The engine is the real HF runner on a real socket; its fault is injected with a forward
hook that raises what CUDA raises once the device is lost.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from eagle3_target.server.app import create_app
from eagle3_target.server.settings import ServerSettings
from eagle3_target.wire import tensors as tensor_wire

from support.cluster.waiting import eventually
from support.server_process import serve_in_thread
from support.supervision import metric_samples

BODY = tensor_wire.encode({"input_ids": torch.arange(8).reshape(1, 8)})


@pytest.mark.parametrize(
    ("fault", "dies"),
    [(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), True), (None, False)],
)
def test_a_dead_engine_fails_readiness_for_good_and_stops_the_server(server_model_dir, tmp_path, fault, dies):
    termination_log = tmp_path / "termination-log"
    termination_log.touch()  # as the kubelet creates it
    settings = ServerSettings(
        model=str(server_model_dir), engine="hf", dtype="float32", termination_log=termination_log
    )
    app = create_app(settings)
    state = app.state.server
    stops: list[str] = []
    state.on_failure = lambda: stops.append("stop")
    with serve_in_thread(app) as url:
        eventually(lambda: httpx.get(url + "/readyz").status_code == 200, "the model to load")
        layer = state.target.runner.model.model.layers[2]

        def raising(*_args: object) -> None:
            raise fault or RuntimeError("a bug in one batch")

        handle = layer.register_forward_hook(raising)
        failed = httpx.post(url + "/v1/supervision", content=BODY)
        handle.remove()
        assert failed.status_code == 500, failed.text
        for _ in range(2):  # for good, and the server is stopped once
            ready = httpx.get(url + "/readyz")
            data = httpx.post(url + "/v1/supervision", content=BODY)
            if not dies:
                assert (ready.status_code, data.status_code) == (200, 200)
                continue
            for answer in (ready, data):
                assert answer.status_code == 503
                error = answer.json()["error"]
                assert error["type"] == "not_ready"
                assert (
                    "the engine has failed: the model lost its device: AcceleratorError" in error["message"]
                )
        assert stops == (["stop"] if dies else [])
        assert metric_samples(url)[("eagle3_ready", ())] == (0 if dies else 1)
    said = termination_log.read_text()
    assert said.startswith("the engine failed: the model lost its device") if dies else said == ""
