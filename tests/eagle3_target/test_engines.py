"""The engine registry is the one list of engines: the CRD, the operator spec and the server agree with it."""

import subprocess
import sys
import typing

import pytest
from eagle3_operator.spec import Eagle3TargetSpec
from eagle3_target.engines import DEFAULT_ENGINE, ENGINES, EngineName
from eagle3_target.runners import ModelRefused, check_engine_args
from eagle3_target.server.settings import ServerSettings

from support.crd import crd_manifest


def crd_engine_schema() -> dict:
    (version,) = crd_manifest()["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["engine"]


def test_the_crd_enum_and_default_are_the_registry():
    schema = crd_engine_schema()
    assert schema["enum"] == list(ENGINES)
    assert schema["default"] == DEFAULT_ENGINE


def test_the_engine_name_type_is_the_registry():
    assert typing.get_args(EngineName) == tuple(ENGINES)


def test_the_operator_spec_accepts_exactly_the_registered_engines():
    annotation = Eagle3TargetSpec.model_fields["engine"].annotation
    assert list(typing.get_args(annotation)) == list(ENGINES)


def test_server_settings_take_the_registered_engines():
    assert ServerSettings(model="/m").engine == DEFAULT_ENGINE
    for engine in ENGINES:
        assert ServerSettings(model="/m", engine=engine).engine == engine
    with pytest.raises(ValueError, match="engine must be one of"):
        ServerSettings(model="/m", engine="trt")


def test_an_unknown_engine_is_refused_before_loading():
    with pytest.raises(ModelRefused, match="unknown engine 'trt'"):
        check_engine_args("trt", {})
    with pytest.raises(ModelRefused, match="takes no engine arguments"):
        check_engine_args("hf", {"enforce_eager": True})


def test_the_registry_imports_without_torch():
    """The CLI and the operator read it; neither may pay for (or, in the operator image, lack) torch."""
    code = "import sys; sys.modules['torch'] = None; import eagle3_target.engines"
    subprocess.run([sys.executable, "-c", code], check=True)
