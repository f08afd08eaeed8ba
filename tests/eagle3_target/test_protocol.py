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
    with pytest.raises(ValueError, match="empty"):
        protocol.read_token_file(tmp_path / "empty")
