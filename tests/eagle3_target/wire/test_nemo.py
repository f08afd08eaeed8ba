"""NeMo's remote-target wire format: byte layout from the spec, round trips, strict rejection."""

import struct

import pytest
import torch
from eagle3_target.wire import WireFormatError
from eagle3_target.wire.nemo import DTYPE_CODES, MAGIC, decode, encode, encode_payload
from hypothesis import given, settings
from hypothesis import strategies as st

SHAPES = st.lists(st.integers(0, 5), min_size=0, max_size=4)


def _random_tensor(dtype, shape, seed):
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = 1
    for dim in shape:
        count *= dim
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (count * itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _bits(t):
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.uint8)


def _entry(key, code, shape, data):
    """One entry laid out by hand from the format description (not by the codec under test)."""
    raw_key = key.encode()
    out = struct.pack("<I", len(raw_key)) + raw_key + bytes([0, code, len(shape)])
    out += b"".join(struct.pack("<q", d) for d in shape)
    return out + struct.pack("<Q", len(data)) + data


def _none_entry(key):
    raw_key = key.encode()
    return struct.pack("<I", len(raw_key)) + raw_key + b"\x01"


HEADER = struct.pack("<I", 0x4E4D4554)


def test_layout_matches_the_specification_byte_for_byte():
    ids = torch.tensor([[3, 4]], dtype=torch.int64)
    probs = torch.tensor([0.5, 1.0], dtype=torch.bfloat16)
    mask = torch.tensor([[[True], [False]]])
    body = encode({"input_ids": ids, "target_probs": probs, "missing": None, "position_mask": mask})
    expected = (
        HEADER
        + _entry("input_ids", 4, [1, 2], struct.pack("<2q", 3, 4))
        + _entry("target_probs", 3, [2], bytes.fromhex("003f803f"))
        + _none_entry("missing")
        + _entry("position_mask", 9, [1, 2, 1], b"\x01\x00")
    )
    assert body == expected
    decoded = decode(expected)
    assert list(decoded) == ["input_ids", "target_probs", "missing", "position_mask"]
    assert decoded["missing"] is None
    assert torch.equal(decoded["input_ids"], ids) and torch.equal(decoded["position_mask"], mask)
    assert decoded["target_probs"].dtype == torch.bfloat16 and torch.equal(decoded["target_probs"], probs)


def test_dtype_codes_are_nemos():
    assert MAGIC == 0x4E4D4554
    assert {
        0: torch.float32,
        1: torch.float64,
        2: torch.float16,
        3: torch.bfloat16,
        4: torch.int64,
        5: torch.int32,
        6: torch.int16,
        7: torch.int8,
        8: torch.uint8,
        9: torch.bool,
    } == DTYPE_CODES


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(
        st.text(max_size=10),
        st.one_of(
            st.none(), st.tuples(st.sampled_from(list(DTYPE_CODES.values())), SHAPES, st.integers(0, 999))
        ),
        max_size=5,
    )
)
def test_round_trip_every_dtype_shape_and_none(specs):
    tensors = {k: None if v is None else _random_tensor(*v) for k, v in specs.items()}
    body = encode(tensors)
    for buf in (body, bytearray(body), memoryview(body)):
        decoded = decode(buf)
        assert list(decoded) == list(tensors)
        for key, t in tensors.items():
            if t is None:
                assert decoded[key] is None
            else:
                got = decoded[key]
                assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(_bits(got), _bits(t))


def test_non_contiguous_input_is_encoded_by_value():
    t = torch.arange(12, dtype=torch.int16).reshape(3, 4).t()
    assert torch.equal(decode(encode({"t": t}))["t"], t)


def test_encode_refuses_dtypes_without_a_code():
    with pytest.raises(ValueError, match="no NeMo wire code"):
        encode({"x": torch.zeros(2, dtype=torch.uint16)})


def test_writable_body_is_decoded_without_copying_and_bytes_are_copied():
    body = encode({"x": torch.zeros(4, dtype=torch.int32)})
    writable = bytearray(body)
    view = decode(writable)["x"]
    writable[-4:] = struct.pack("<i", 7)
    assert int(view[-1]) == 7
    private = decode(body)["x"]
    private += 1
    assert torch.equal(decode(body)["x"], torch.zeros(4, dtype=torch.int32))


GOOD = _entry("x", 0, [2], bytes(8))


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"", "truncated in the magic"),
        (b"NMET", "not a NeMo wire body"),
        (struct.pack("<I", 0x12345678) + GOOD, "magic 0x12345678"),
        (HEADER + b"\x05\x00", "truncated in a key length"),
        (HEADER + struct.pack("<I", 1 << 31) + b"x", "truncated in a key"),
        (HEADER + struct.pack("<I", 2) + b"\xff\xfe\x00", "UTF-8"),
        (HEADER + struct.pack("<I", 1) + b"x", "truncated in the flags"),
        (HEADER + struct.pack("<I", 1) + b"x\x02", "unknown flags"),
        (HEADER + struct.pack("<I", 1) + b"x\x00\x0a\x01", "unknown dtype code 10"),
        (HEADER + struct.pack("<I", 1) + b"x\x00\x00\x02" + struct.pack("<q", 2), "truncated in the shape"),
        (HEADER + struct.pack("<I", 1) + b"x\x00\x00\x01" + struct.pack("<q", -1), "invalid dimension"),
        (HEADER + _entry("x", 0, [2], bytes(8))[:-3], "truncated in the data"),
        (HEADER + _entry("x", 0, [3], bytes(8)), "8 bytes for shape \\[3\\]"),
        (HEADER + _entry("x", 0, [1 << 40, 1 << 40], bytes(8)), "expected"),
        (HEADER + GOOD + GOOD, "repeats key 'x'"),
        (HEADER + _entry("m", 9, [3], b"\x00\x01\x02"), "bytes other than 0 and 1"),
        (HEADER + GOOD + b"\x00", "truncated"),
    ],
)
def test_malformed_bodies_are_rejected_clearly(body, match):
    with pytest.raises(WireFormatError, match=match):
        decode(body)


def test_byte_count_claims_are_checked_before_any_allocation():
    huge = (
        HEADER
        + struct.pack("<I", 1)
        + b"x\x00\x08\x01"
        + struct.pack("<q", 1 << 50)
        + struct.pack("<Q", 1 << 50)
    )
    with pytest.raises(WireFormatError, match="truncated in the data"):
        decode(huge)


def test_total_size_limit():
    body = encode({"x": torch.zeros(16)})
    assert decode(body, max_total_bytes=len(body))["x"].shape == (16,)
    with pytest.raises(WireFormatError, match="exceeds"):
        decode(body, max_total_bytes=len(body) - 1)


def test_every_truncation_is_rejected():
    body = encode(
        {"aux": torch.ones(2, 3, dtype=torch.bfloat16), "none": None, "m": torch.ones(2, dtype=torch.bool)}
    )
    for cut in range(len(body)):
        try:
            decoded = decode(body[:cut])
        except WireFormatError:
            continue
        # A cut exactly between two entries is a valid, shorter body (the format has no entry count).
        assert encode(decoded) == body[:cut]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_corrupted_bodies_decode_or_raise_wire_format_error(data):
    body = bytearray(encode({"a": torch.arange(6, dtype=torch.int32), "n": None, "b": torch.ones(2)}))
    edits = data.draw(st.lists(st.tuples(st.integers(0, len(body) - 1), st.integers(0, 255)), max_size=4))
    for pos, value in edits:
        body[pos] = value
    try:
        decoded = decode(bytes(body))
    except WireFormatError:
        return
    assert sum(t.numel() * t.element_size() for t in decoded.values() if t is not None) <= len(body)


def test_the_payload_streams_the_same_bytes_in_chunks():
    tensors = {"aux": torch.randn(3, 5), "none": None, "ids": torch.arange(7)}
    payload = encode_payload(tensors)
    assert b"".join(bytes(piece) for piece in payload.chunks(4)) == encode(tensors)
    assert payload.nbytes == len(encode(tensors))
