"""The shared protocol names what the CRD and the server really use, and imports without torch."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from eagle3_target import protocol

ROOT = Path(__file__).resolve().parents[2]


def test_resource_names_match_the_crd():
    crd = yaml.safe_load((ROOT / "crds" / f"{protocol.PLURAL}.{protocol.GROUP}.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    assert crd["spec"]["group"] == protocol.GROUP
    assert crd["spec"]["names"]["plural"] == protocol.PLURAL
    assert crd["spec"]["names"]["kind"] == protocol.KIND
    assert version["name"] == protocol.VERSION
    assert f"{protocol.GROUP}/{protocol.VERSION}" == protocol.API_VERSION


def test_every_format_ships_the_aux_hidden_states_first():
    for name, fmt in protocol.FORMATS.items():
        assert fmt.tensors[0] == "aux_hidden_states", name
        assert len(set(fmt.tensors)) == len(fmt.tensors), name
        assert not (fmt.needs_vocab and fmt.takes_dtype), name


def test_imports_without_torch():
    """The operator image has no torch; a torch import here would break the operator at startup."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import eagle3_target.protocol, eagle3_operator.constants\n"
        "print(sorted(m for m in sys.modules if m.startswith(('torch', 'transformers'))))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "['torch']"  # only the blocker this test planted


def test_target_info_round_trips_and_ignores_unknown_fields():
    info = protocol.TargetInfo(
        model="tiny",
        engine="hf",
        dtype="bfloat16",
        num_hidden_layers=4,
        hidden_size=32,
        vocab_size=256,
        aux_layer_ids=[0, 1, 2],
        fingerprint="sha256:aa",
        formats=list(protocol.FORMATS),
        max_batch_tokens=1024,
        max_model_len=128,
        version="0.1.0",
    )
    payload = info.model_dump(mode="json") | {"added_later": True}
    assert protocol.TargetInfo.model_validate(payload) == info
    assert payload["revision"] is None


def test_token_file_is_stripped_and_must_not_be_empty(tmp_path: Path):
    (tmp_path / "t").write_text("  abc\n")
    assert protocol.read_token_file(tmp_path / "t") == "abc"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(protocol.TokenFileError, match="empty"):
        protocol.read_token_file(tmp_path / "empty")
    with pytest.raises(protocol.TokenFileError, match=r"cannot read token file .*No such file"):
        protocol.read_token_file(tmp_path / "missing")


def test_an_older_servers_info_means_its_aux_layers_are_its_capture_set():
    older = {
        "model": "tiny",
        "engine": "hf",
        "dtype": "float32",
        "num_hidden_layers": 8,
        "hidden_size": 64,
        "vocab_size": 256,
        "aux_layer_ids": [1, 3, 4],
        "fingerprint": "sha256:aa",
        "formats": list(protocol.FORMATS),
        "max_batch_tokens": 1024,
        "max_model_len": 128,
        "version": "0.1.0",
    }
    info = protocol.TargetInfo.model_validate(older)
    assert info.captured_layers == [1, 3, 4]
    assert info.served_model().to_status()["captureLayerIds"] == [1, 3, 4]
    wider = protocol.TargetInfo.model_validate(older | {"capture_layer_ids": [7, 1, 3, 4]})
    assert wider.captured_layers == [7, 1, 3, 4]
    assert wider.served_model().to_status()["captureLayerIds"] == [7, 1, 3, 4]


CAPTURED = [7, 1, 3, 0, 4]


@pytest.mark.parametrize(
    ("layers", "final", "selected", "tensors"),
    [
        (None, None, (7, 1, 3, 0, 4), ("hidden_states",)),
        ("4, 0", "postnorm", (4, 0), ("hidden_states", "final_hidden")),
        ("none", "prenorm", (), ("final_hidden_prenorm",)),
        (" none ", "postnorm", (), ("final_hidden",)),
    ],
)
def test_a_layer_selection_parses_and_round_trips(layers, final, selected, tensors):
    selection = protocol.LayerSelection.parse(layers, final, CAPTURED)
    assert selection.layers == selected and selection.tensors == tensors
    query = selection.query()
    assert query["format"] == protocol.LAYERS_FORMAT
    assert protocol.LayerSelection.parse(query["layers"], query["final"], CAPTURED) == selection


@pytest.mark.parametrize(
    ("layers", "final", "reason"),
    [
        ("2,7", None, r"layers \[2\] are not captured by this target; it captures \[7, 1, 3, 0, 4\]"),
        ("", None, "comma-separated list"),
        ("1,,3", None, "comma-separated list"),
        ("1;3", None, "comma-separated list"),
        ("-1", None, r"layers \[-1\] are not captured"),
        ("1,1", None, "must be distinct"),
        ("1", "after", "unknown final state 'after'"),
        ("none", None, "ask for a final state"),
        ("none", "none", "ask for a final state"),
    ],
)
def test_a_bad_layer_selection_says_why(layers, final, reason):
    with pytest.raises(ValueError, match=reason):
        protocol.LayerSelection.parse(layers, final, CAPTURED)
