"""The safetensors codec: exact round trips, compatibility with the safetensors library, strict rejection."""

import json
import struct

import pytest
import safetensors.torch
import torch
from eagle3_target.wire import WireFormatError
from eagle3_target.wire.tensors import DTYPES, decode, encode, encode_payload
from hypothesis import given, settings
from hypothesis import strategies as st

SHAPES = st.lists(st.integers(0, 5), min_size=0, max_size=4)  # includes 0-d and empty tensors


def _random_tensor(dtype, shape, seed):
    """Random bits reinterpreted as dtype: exercises every bit pattern (NaNs included) byte for byte."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = 1
    for dim in shape:
        count *= dim
    raw = torch.randint(
        0, 256, (count * itemsize,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _bits(t):
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.uint8)


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


TENSOR_DICTS = st.dictionaries(
    st.text(min_size=1, max_size=12).filter(lambda k: k != "__metadata__"),
    st.tuples(st.sampled_from(sorted(DTYPES.values(), key=str)), SHAPES, st.integers(0, 1000)),
    max_size=5,
)


@settings(max_examples=150, deadline=None)
@given(TENSOR_DICTS, st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3))
def test_round_trip_every_dtype_and_shape(specs, metadata):
    tensors = {name: _random_tensor(dtype, shape, seed) for name, (dtype, shape, seed) in specs.items()}
    body = encode(tensors, metadata)
    for buf in (body, bytearray(body), memoryview(body)):
        decoded, meta = decode(buf)
        assert meta == metadata
        assert set(decoded) == set(tensors)
        for name, t in tensors.items():
            assert _same_bits(decoded[name], t), name


@settings(max_examples=60, deadline=None)
@given(TENSOR_DICTS)
def test_interoperates_with_the_safetensors_library(specs):
    tensors = {name: _random_tensor(dtype, shape, seed) for name, (dtype, shape, seed) in specs.items()}
    ours = encode(tensors, {"format": "pt"})
    theirs = safetensors.torch.save(tensors, {"format": "pt"})
    loaded_by_library = safetensors.torch.load(ours)
    decoded_by_us, meta = decode(theirs)
    assert meta == {"format": "pt"}
    for name, t in tensors.items():
        assert _same_bits(loaded_by_library[name], t) and _same_bits(decoded_by_us[name], t), name


def test_non_contiguous_views_and_shared_storage_are_encoded_by_value():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {"t": base.t(), "row": base[1], "slice": base[:, ::2]}
    decoded, _ = decode(encode(tensors))
    for name, t in tensors.items():
        assert torch.equal(decoded[name], t)


def test_writable_body_is_decoded_without_copying():
    body = bytearray(encode({"x": torch.arange(16, dtype=torch.int64)}))
    decoded, _ = decode(body)
    body[-8:] = struct.pack("<q", 99)  # the tensor is a view of the caller's buffer
    assert int(decoded["x"][-1]) == 99


def test_read_only_body_gives_writable_tensors_independent_of_it():
    body = encode({"x": torch.zeros(4)})
    decoded, _ = decode(body)
    decoded["x"] += 1
    assert torch.equal(decode(body)[0]["x"], torch.zeros(4))


def test_misaligned_buffers_still_decode():
    body = encode({"x": torch.arange(5, dtype=torch.float64)})
    shifted = bytearray(b"\0" + body)
    decoded, _ = decode(memoryview(shifted)[1:])
    assert torch.equal(decoded["x"], torch.arange(5, dtype=torch.float64))


def test_encode_refuses_what_safetensors_cannot_hold():
    with pytest.raises(ValueError, match="dtype"):
        encode({"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(ValueError, match="reserved"):
        encode({"__metadata__": torch.zeros(1)})
    with pytest.raises(ValueError, match="str to str"):
        encode({"x": torch.zeros(1)}, {"n": 1})


def _body(header, data=b""):
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


GOOD = {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"", "shorter than"),
        (b"\x01\x00\x00", "shorter than"),
        (struct.pack("<Q", 1 << 40) + b"{}", "exceeds"),
        (struct.pack("<Q", 100) + b"{}", "claims 100 bytes"),
        (struct.pack("<Q", 4) + b"\xff\xfe{}", "UTF-8 JSON"),
        (struct.pack("<Q", 3) + b"{x}", "UTF-8 JSON"),
        (_body([1, 2]), "JSON object"),
        (struct.pack("<Q", 37) + b'{"__metadata__":{},"__metadata__":{}}', "duplicate keys"),
        (_body({"__metadata__": {"a": 1}}), "__metadata__"),
        (struct.pack("<Q", 5000) + b"[" + b"1" * 4998 + b"]", "UTF-8 JSON"),  # int too long to convert
        (_body({"m": {"dtype": "BOOL", "shape": [2], "data_offsets": [0, 2]}}, b"\x01\xff"), "0 and 1"),
        (_body({"x": {"dtype": "F32", "shape": [2]}}, bytes(8)), "exactly dtype"),
        (_body({"x": {**GOOD["x"], "extra": 1}}, bytes(8)), "exactly dtype"),
        (_body({"x": {**GOOD["x"], "dtype": "C64"}}, bytes(8)), "unsupported dtype"),
        (_body({"x": {**GOOD["x"], "dtype": 1}}, bytes(8)), "unsupported dtype"),
        (_body({"x": {**GOOD["x"], "shape": [2.0]}}, bytes(8)), "list of at most"),
        (_body({"x": {**GOOD["x"], "shape": [True, 2]}}, bytes(8)), "list of at most"),
        (_body({"x": {**GOOD["x"], "shape": [1] * 40}}, bytes(8)), "list of at most"),
        (_body({"x": {**GOOD["x"], "shape": [-2]}}, bytes(8)), "invalid dimension|bytes for shape"),
        (_body({"x": {**GOOD["x"], "shape": [3]}}, bytes(8)), "expected 12"),
        (_body({"x": {**GOOD["x"], "shape": [1 << 62, 1 << 62]}}, bytes(8)), "expected"),
        (_body({"x": {**GOOD["x"], "data_offsets": [0]}}, bytes(8)), "two integers"),
        (_body({"x": {**GOOD["x"], "data_offsets": [8, 0]}}, bytes(8)), "outside"),
        (_body(GOOD, bytes(4)), "outside"),
        (_body(GOOD, bytes(12)), "trailing bytes"),
        (
            _body({"x": GOOD["x"], "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)),
            "gap or overlap",
        ),
        (
            _body(
                {
                    "x": {**GOOD["x"], "data_offsets": [4, 12]},
                    "y": {**GOOD["x"], "shape": [0], "data_offsets": [0, 0]},
                },
                bytes(12),
            ),
            "gap or overlap",
        ),
    ],
)
def test_malformed_bodies_are_rejected_clearly(body, match):
    with pytest.raises(WireFormatError, match=match):
        decode(body)


def test_limits_on_tensor_count_and_header_size():
    body = encode({f"t{i}": torch.zeros(1) for i in range(10)})
    assert len(decode(body, max_tensors=10)[0]) == 10
    with pytest.raises(WireFormatError, match="more than the 9 limit"):
        decode(body, max_tensors=9)
    with pytest.raises(WireFormatError, match="exceeds the 16"):
        decode(body, max_header_bytes=16)


def test_wire_error_is_a_value_error():
    assert issubclass(WireFormatError, ValueError)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_corrupted_bodies_decode_or_raise_wire_format_error(data):
    body = bytearray(
        encode({"a": torch.arange(6, dtype=torch.int32).reshape(2, 3), "b": torch.ones(2)}, {"k": "v"})
    )
    cut = data.draw(st.integers(0, len(body)))
    edits = data.draw(st.lists(st.tuples(st.integers(0, len(body) - 1), st.integers(0, 255)), max_size=4))
    for pos, value in edits:
        body[pos] = value
    try:
        tensors, _ = decode(bytes(body[:cut]))
    except WireFormatError:
        return
    assert sum(t.numel() * t.element_size() for t in tensors.values()) <= cut


@settings(max_examples=30, deadline=None)
@given(TENSOR_DICTS, st.integers(1, 64))
def test_the_payload_is_the_librarys_file_in_chunks_that_view_the_tensors(specs, chunk):
    tensors = {name: _random_tensor(dtype, shape, seed) for name, (dtype, shape, seed) in specs.items()}
    payload = encode_payload(tensors, {"format": "pt"})
    streamed = b"".join(bytes(piece) for piece in payload.chunks(chunk))
    assert all(piece.nbytes <= chunk for piece in payload.chunks(chunk))
    assert payload.nbytes == len(streamed)
    assert streamed == safetensors.torch.save(tensors, {"format": "pt"})


def test_payload_segments_share_the_tensors_memory():
    tensor = torch.arange(1 << 16, dtype=torch.float32)
    payload = encode_payload({"x": tensor})
    data = payload.segments[-1]
    assert data.nbytes == tensor.nbytes and not data.readonly
    tensor[0] = 42.0  # the body sees the tensor's own storage: nothing was copied
    assert bytes(data[:4]) == tensor[:1].numpy().tobytes()
