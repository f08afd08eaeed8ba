"""The `layers` format of a real server (HF engine) against transformers' own hidden states, its refusals,
and `TargetClient.hidden_states` over it. The server captures [7, 1, 3, 0, 4] of the tiny Llama's 8 layers
(see the `server` fixture): id 7 is the last decoder layer, whose output is h_L before the final norm."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from eagle3_target.client import TargetClient
from eagle3_target.wire import tensors as tensor_wire
from torch import Tensor
from transformers import AutoModelForCausalLM

from support.supervision import supervise, token_batch

LAST = 7  # the tiny Llama has 8 decoder layers


@pytest.fixture(scope="module")
def transformers_states(server_model_dir: Path):
    """`states(ids, mask)`: transformers' `output_hidden_states` (entry i+1 = output of layer i, the last
    entry after the final norm) and the last decoder layer's own output (h_L before the norm)."""
    model = AutoModelForCausalLM.from_pretrained(server_model_dir, dtype=torch.float32).eval()

    def states(ids: Tensor, mask: Tensor) -> tuple[tuple[Tensor, ...], Tensor]:
        taken: list[Tensor] = []
        hook = model.model.layers[LAST].register_forward_hook(
            lambda _m, _i, out: taken.append(out[0] if isinstance(out, tuple) else out)
        )
        try:
            with torch.no_grad():
                out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        finally:
            hook.remove()
        return out.hidden_states, taken[0]

    return states


def close(got: Tensor, want: Tensor, mask: Tensor) -> None:
    valid = mask.bool()
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)


def test_every_captured_layer_in_capture_order_by_default(server, transformers_states):
    ids, mask, _ = token_batch(21, 3, 19, pad_last=6)
    with httpx.Client() as client:
        got, metadata = supervise(
            client, server.url, {"input_ids": ids, "attention_mask": mask}, format="layers"
        )
    hidden, prenorm = transformers_states(ids, mask)
    assert sorted(got) == ["hidden_states"]
    want = torch.cat([prenorm, hidden[2], hidden[4], hidden[1], hidden[5]], dim=-1)
    close(got["hidden_states"], want, mask)
    assert metadata["format"] == "layers" and metadata["final"] == "none"
    assert json.loads(metadata["layers"]) == json.loads(metadata["capture_layer_ids"]) == [7, 1, 3, 0, 4]


@pytest.mark.parametrize(
    ("layers", "final", "tensors"),
    [
        ("4,0", "postnorm", ["final_hidden", "hidden_states"]),  # DSpark-like: layers + post-norm final
        ("3,1,7", "prenorm", ["final_hidden_prenorm", "hidden_states"]),  # EAGLE-3 + last, speculators-like
        ("none", "prenorm", ["final_hidden_prenorm"]),  # MTP: the pre-norm last state alone
    ],
)
def test_chosen_layers_and_final_state(server, transformers_states, layers, final, tensors):
    ids, mask, _ = token_batch(22, 2, 13, pad_last=4)
    with httpx.Client() as client:
        got, metadata = supervise(
            client,
            server.url,
            {"input_ids": ids, "attention_mask": mask},
            format="layers",
            layers=layers,
            final=final,
        )
    hidden, prenorm = transformers_states(ids, mask)
    assert sorted(got) == tensors
    by_id = {i: hidden[i + 1] for i in range(LAST)} | {LAST: prenorm}
    if "hidden_states" in got:
        wanted = [int(i) for i in layers.split(",")]
        close(got["hidden_states"], torch.cat([by_id[i] for i in wanted], dim=-1), mask)
        assert json.loads(metadata["layers"]) == wanted
    if final == "postnorm":
        close(got["final_hidden"], hidden[-1], mask)  # transformers' last entry: after the final norm
    else:
        close(got["final_hidden_prenorm"], prenorm, mask)
    assert metadata["final"] == final


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
    with httpx.Client() as client:
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
    response = httpx.post(
        server.url + "/v1/supervision",
        params={"format": "hidden", **params},
        content=tensor_wire.encode({"input_ids": ids}),
    )
    assert response.status_code == 422
    assert "apply to format=layers only" in response.json()["error"]["message"]


def test_client_hidden_states(server, transformers_states):
    ids, mask, _ = token_batch(25, 2, 11, pad_last=3)
    hidden, prenorm = transformers_states(ids, mask)
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
    close(
        everything["hidden_states"],
        torch.cat([prenorm, hidden[2], hidden[4], hidden[1], hidden[5]], -1),
        mask,
    )
    close(dspark["hidden_states"], torch.cat([hidden[1], hidden[5]], -1), mask)
    close(dspark["final_hidden"], hidden[-1], mask)
    assert sorted(mtp) == ["final_hidden_prenorm"]
    close(mtp["final_hidden_prenorm"], prenorm, mask)
