"""The `layers` format of a real server (HF engine) against transformers' own hidden states, its refusals,
and `TargetClient.hidden_states` over it. The server captures [7, 1, 3, 0, 4] of the tiny Llama's 8 layers
(see the `server` fixture): id 7 is the last decoder layer, whose output is h_L before the final norm."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from eagle3_target.client import TargetClient
from eagle3_target.wire import tensors as tensor_wire
from torch import Tensor
from transformers import AutoModelForCausalLM

from support.hidden_states import TransformersStates, transformers_states
from support.supervision import supervise, token_batch


@pytest.fixture(scope="module")
def states(server_model_dir: Path) -> Callable[[Tensor, Tensor], TransformersStates]:
    """What transformers computes for a batch on the served checkpoint (support.hidden_states)."""
    model = AutoModelForCausalLM.from_pretrained(server_model_dir, dtype=torch.float32).eval()
    return lambda ids, mask: transformers_states(model, ids, mask)


def http() -> httpx.Client:
    return httpx.Client(timeout=120, trust_env=False)


def close(got: Tensor, want: Tensor, mask: Tensor) -> None:
    valid = mask.bool()
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)


def test_every_captured_layer_in_capture_order_by_default(server, states):
    ids, mask, _ = token_batch(21, 3, 19, pad_last=6)
    with http() as client:
        got, metadata = supervise(
            client, server.url, {"input_ids": ids, "attention_mask": mask}, format="layers"
        )
    assert sorted(got) == ["hidden_states"]
    close(got["hidden_states"], states(ids, mask).captured([7, 1, 3, 0, 4]), mask)
    assert metadata["format"] == "layers" and metadata["final"] == "none"
    assert json.loads(metadata["layers"]) == json.loads(metadata["capture_layer_ids"]) == [7, 1, 3, 0, 4]


# DSpark-like: layers and the post-norm final; EAGLE-3 plus the last, speculators-like; MTP: the pre-norm
# last state alone.
SELECTIONS = [
    ("4,0", "postnorm", ["final_hidden", "hidden_states"]),
    ("3,1,7", "prenorm", ["final_hidden_prenorm", "hidden_states"]),
    ("none", "prenorm", ["final_hidden_prenorm"]),
]


def assert_selection(got: dict[str, Tensor], want: TransformersStates, layers: str, final: str, mask: Tensor):
    if layers != "none":
        close(got["hidden_states"], want.captured([int(i) for i in layers.split(",")]), mask)
    if final == "postnorm":
        close(got["final_hidden"], want.postnorm, mask)
    else:
        close(got["final_hidden_prenorm"], want.prenorm, mask)


@pytest.mark.parametrize(("layers", "final", "tensors"), SELECTIONS)
def test_chosen_layers_and_final_state(server, states, layers, final, tensors):
    ids, mask, _ = token_batch(22, 2, 13, pad_last=4)
    with http() as client:
        got, metadata = supervise(
            client,
            server.url,
            {"input_ids": ids, "attention_mask": mask},
            format="layers",
            layers=layers,
            final=final,
        )
    assert sorted(got) == tensors
    assert_selection(got, states(ids, mask), layers, final, mask)
    assert json.loads(metadata["layers"]) == ([] if layers == "none" else [int(i) for i in layers.split(",")])
    assert metadata["final"] == final


def test_concurrent_selections_each_get_their_own_tensors(server, states):
    """Requests of one length arriving together may be batched: each still gets the layers it asked for."""
    ids, mask, _ = token_batch(26, 2, 17, pad_last=5)
    want = states(ids, mask)
    start = threading.Barrier(len(SELECTIONS) * 2)
    answers: dict[int, dict[str, Tensor]] = {}

    def pull(i: int) -> None:
        layers, final, _ = SELECTIONS[i % len(SELECTIONS)]
        with http() as client:
            start.wait()
            params = {"format": "layers", "layers": layers, "final": final}
            answers[i] = supervise(client, server.url, {"input_ids": ids, "attention_mask": mask}, **params)[
                0
            ]

    threads = [threading.Thread(target=pull, args=(i,)) for i in range(start.parties)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert sorted(answers) == list(range(start.parties))
    for i, got in answers.items():
        layers, final, tensors = SELECTIONS[i % len(SELECTIONS)]
        assert sorted(got) == tensors
        assert_selection(got, want, layers, final, mask)


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ({"layers": "2"}, "layers [2] are not captured by this target; it captures [7, 1, 3, 0, 4]"),
        ({"layers": "1,99"}, "layers [99] are not captured"),
        ({"layers": ""}, "comma-separated list of layer ids"),
        ({"layers": "1,x"}, "comma-separated list of layer ids"),
        ({"layers": "1,1"}, "layers must be distinct"),
        ({"final": "normed"}, "unknown final state 'normed'"),
        ({"layers": "none"}, "layers=none asks for no tensor"),
        ({"layers": "none", "final": "none"}, "layers=none asks for no tensor"),
        ({"vocab": "v"}, "takes no vocab or dtype"),
        ({"dtype": "float32"}, "takes no vocab or dtype"),
    ],
)
def test_bad_selections_are_422_with_the_reason(server, params, reason):
    ids, mask, _ = token_batch(23, 1, 5)
    body = tensor_wire.encode({"input_ids": ids, "attention_mask": mask})
    with http() as client:
        response = client.post(
            server.url + "/v1/supervision", params={"format": "layers", **params}, content=body
        )
        assert response.status_code == 422, response.text
        assert reason in response.json()["error"]["message"]
        # The server keeps serving.
        assert supervise(client, server.url, {"input_ids": ids}, format="layers")[0]


@pytest.mark.parametrize("params", [{"layers": "1"}, {"final": "prenorm"}])
def test_layers_and_final_belong_to_the_layers_format(server, params):
    ids, _, _ = token_batch(24, 1, 5)
    response = http().post(
        server.url + "/v1/supervision",
        params={"format": "hidden", **params},
        content=tensor_wire.encode({"input_ids": ids}),
    )
    assert response.status_code == 422
    assert "apply to format=layers only" in response.json()["error"]["message"]


def test_client_hidden_states(server, states):
    ids, mask, _ = token_batch(25, 2, 11, pad_last=3)
    want = states(ids, mask)
    with TargetClient(server.url) as client:
        everything = client.hidden_states(ids, mask)
        dspark = client.hidden_states(ids, mask, layers=[0, 4], final="postnorm")
        mtp = client.hidden_states(ids, mask, layers=(), final="prenorm")
        requests_before = client.stats["requests"]
        with pytest.raises(
            ValueError, match=r"layers \[2, 5\] are not captured .* captures \[7, 1, 3, 0, 4\]"
        ):
            client.hidden_states(ids, mask, layers=[1, 2, 5])
        with pytest.raises(ValueError, match="ask for a final state"):
            client.hidden_states(ids, mask, layers=())
        assert client.stats["requests"] == requests_before  # refused before any request
    assert sorted(everything) == ["hidden_states"]
    close(everything["hidden_states"], want.captured([7, 1, 3, 0, 4]), mask)
    assert sorted(dspark) == ["final_hidden", "hidden_states"]
    assert_selection(dspark, want, "0,4", "postnorm", mask)
    assert sorted(mtp) == ["final_hidden_prenorm"]
    assert_selection(mtp, want, "none", "prenorm", mask)
