"""Tensor codec: bit-exact round trips for every dtype, and one test per malformed tensor."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.pb import rlfleet_pb2 as pb
from services.core.transport import codec
from services.core.transport.codec import DTYPES, NP_DTYPES, WireError, array_from_proto, tensor_to_proto

MB = 1 << 20
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


def raw_bytes(t: torch.Tensor | np.ndarray[Any, Any]) -> bytes:
    """The tensor's or array's memory as bytes, independent of the codec (bitwise, so NaN payloads count)."""
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t).tobytes()
    flat = t.contiguous().reshape(-1)
    return bytes(flat.view(torch.uint8).tolist()) if flat.numel() else b""


@st.composite
def tensors(draw: st.DrawFn, dtype_name: str) -> torch.Tensor:
    torch_dtype, np_dtype = DTYPES[dtype_name]
    shape = draw(shapes)
    n = 1
    for d in shape:
        n *= d
    if dtype_name == "bool":
        bits = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        return torch.tensor(bits, dtype=torch.bool).reshape(shape)
    data = draw(st.binary(min_size=n * np_dtype.itemsize, max_size=n * np_dtype.itemsize))
    if not data:
        return torch.empty(shape, dtype=torch_dtype)
    # Any bit pattern, so floats include NaNs with arbitrary payloads, infinities and -0.0.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(torch_dtype).reshape(shape)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_round_trip_is_bit_exact(dtype_name: str, data: st.DataObject) -> None:
    t = data.draw(tensors(dtype_name))
    wire = tensor_to_proto(t).SerializeToString()
    msg = pb.Tensor.FromString(wire)
    assert msg.dtype == dtype_name and tuple(msg.shape) == tuple(t.shape)
    out = array_from_proto(msg, max_bytes=MB)
    # Every service decodes to numpy: bfloat16 as its int16 bit pattern, bool as numpy's bool.
    want = np.dtype(np.bool_) if dtype_name == "bool" else NP_DTYPES[dtype_name].newbyteorder("=")
    assert out.dtype == want and out.shape == tuple(t.shape)
    assert raw_bytes(out) == raw_bytes(t)


@pytest.mark.parametrize("bits", [0x7FC00001, 0xFFFFFFFF, 0x7F800001, 0x80000000, 0x7F800000])
def test_float32_special_bit_patterns_survive(bits: int) -> None:
    t = torch.frombuffer(bytearray(struct.pack("<I", bits)), dtype=torch.float32).clone()
    out = array_from_proto(tensor_to_proto(t), max_bytes=MB)
    assert struct.unpack("<I", raw_bytes(out))[0] == bits


def test_wire_bytes_are_little_endian_c_order() -> None:
    t = torch.arange(6, dtype=torch.int32).reshape(2, 3).t()  # non-contiguous view
    msg = tensor_to_proto(t)
    assert list(msg.shape) == [3, 2]
    assert msg.data == struct.pack("<6i", 0, 3, 1, 4, 2, 5)
    assert tensor_to_proto(torch.tensor(1.0, dtype=torch.bfloat16)).data == b"\x80\x3f"


def test_decoded_tensor_owns_writable_memory() -> None:
    msg = tensor_to_proto(torch.ones(2, 3, requires_grad=True))
    out = array_from_proto(msg, max_bytes=MB)
    out += 1  # must not raise (read-only buffer) nor write through to the message
    assert np.array_equal(out, np.full((2, 3), 2.0, dtype=np.float32))
    assert float(array_from_proto(msg, max_bytes=MB).sum()) == 6.0


def test_unsupported_dtype_cannot_be_encoded() -> None:
    with pytest.raises(WireError) as exc:
        tensor_to_proto(torch.zeros(2, dtype=torch.complex64))
    assert exc.value.reason == "unknown_dtype"


def _msg(dtype: str, shape: list[int], data: bytes) -> pb.Tensor:
    return pb.Tensor(dtype=dtype, shape=shape, data=data)


def test_truncated_bytes_rejected() -> None:
    with pytest.raises(WireError) as exc:
        array_from_proto(_msg("float32", [2, 3], b"\0" * 12), max_bytes=MB, name="behaviour_logprobs")
    assert exc.value.reason == "truncated_bytes"
    assert str(exc.value) == "tensor 'behaviour_logprobs': 12 bytes for shape (2, 3) float32, expected 24"


def test_trailing_bytes_rejected() -> None:
    with pytest.raises(WireError) as exc:
        array_from_proto(_msg("int64", [2], b"\0" * 24), max_bytes=MB, name="group_ids")
    assert exc.value.reason == "trailing_bytes"
    assert "'group_ids'" in str(exc.value) and "expected 16" in str(exc.value)


def test_unknown_dtype_rejected() -> None:
    with pytest.raises(WireError) as exc:
        array_from_proto(_msg("complex64", [1], b"\0" * 8), max_bytes=MB, name="values")
    assert exc.value.reason == "unknown_dtype"
    assert "'values'" in str(exc.value) and "'complex64'" in str(exc.value)


def test_negative_shape_rejected() -> None:
    with pytest.raises(WireError) as exc:
        array_from_proto(_msg("float32", [2, -3], b""), max_bytes=MB, name="rewards")
    assert exc.value.reason == "negative_shape"
    assert "'rewards'" in str(exc.value) and "(2, -3)" in str(exc.value)


@pytest.mark.parametrize("shape", [[1 << 20, 1 << 20], [1 << 31, 1 << 31, 1 << 31], [0, 1 << 62]])
def test_overflowing_shape_rejected_before_allocation(
    shape: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_alloc(*a: object, **k: object) -> None:
        raise AssertionError("allocated before validating the shape")

    monkeypatch.setattr(codec.np, "frombuffer", no_alloc)
    monkeypatch.setattr(torch, "from_numpy", no_alloc)
    with pytest.raises(WireError) as exc:
        array_from_proto(_msg("float32", shape, b""), max_bytes=MB, name="prompt_ids")
    assert exc.value.reason == "shape_overflow"
    assert "'prompt_ids'" in str(exc.value) and f"limit of {MB} bytes" in str(exc.value)


def test_too_many_dims_rejected() -> None:
    with pytest.raises(WireError) as exc:
        array_from_proto(_msg("uint8", [1] * 40, b"\0"), max_bytes=MB)
    assert exc.value.reason == "shape_overflow"
    assert "40 dimensions" in str(exc.value)


def test_oversized_payload_rejected() -> None:
    with pytest.raises(WireError) as exc:
        array_from_proto(_msg("uint8", [2048], b"\0" * 2048), max_bytes=1024, name="response_ids")
    assert exc.value.reason == "oversized_payload"
    assert "'response_ids'" in str(exc.value) and "2048 bytes exceeds the limit of 1024" in str(exc.value)


def test_dtype_mismatch_rejected() -> None:
    msg = tensor_to_proto(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(WireError) as exc:
        array_from_proto(msg, max_bytes=MB, expect_dtype="float32", name="values")
    assert exc.value.reason == "dtype_mismatch"
    assert str(exc.value) == "tensor 'values': dtype float64, expected float32"


def test_shape_mismatch_rejected() -> None:
    msg = tensor_to_proto(torch.zeros(2, 3))
    with pytest.raises(WireError) as exc:
        array_from_proto(msg, max_bytes=MB, expect_shape=(2, None, 1), name="values")
    assert exc.value.reason == "shape_mismatch"
    assert str(exc.value) == "tensor 'values': shape (2, 3), expected (2, *, 1)"
    assert array_from_proto(msg, max_bytes=MB, expect_shape=(None, 3)).shape == (2, 3)


def test_bool_bytes_other_than_zero_or_one_rejected() -> None:
    with pytest.raises(WireError) as exc:
        array_from_proto(_msg("bool", [3], b"\x00\x01\x07"), max_bytes=MB, name="response_mask")
    assert exc.value.reason == "invalid_bool"
    assert "'response_mask'" in str(exc.value)
