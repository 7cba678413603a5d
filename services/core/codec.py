"""Tensors on the wire: dtype + shape + raw little-endian C-order bytes, never pickle.

Decoding is the trust boundary: a peer (or a corrupted stream entry) can send any bytes, so every
check runs before memory is allocated, and every failure is a `WireError` whose `reason` is a short
machine-readable tag (for the dead-letter stream and metrics) and whose message names the field.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

from services.core.pb import rlfleet_pb2 as pb

# Bumped when the meaning or layout of a field changes; receivers reject any other value.
SCHEMA_VERSION = 1
# torch supports at most 64 dimensions; nothing in rlfleet needs more than a handful.
MAX_NDIM = 16
_INT64_MAX = 2**63 - 1

# wire name -> (torch dtype, little-endian numpy dtype used to (de)serialise it).
# bfloat16 has no numpy type: it travels as its int16 bit pattern. bool travels as uint8 (0/1).
DTYPES: dict[str, tuple[torch.dtype, np.dtype[Any]]] = {
    "float32": (torch.float32, np.dtype("<f4")),
    "float64": (torch.float64, np.dtype("<f8")),
    "float16": (torch.float16, np.dtype("<f2")),
    "bfloat16": (torch.bfloat16, np.dtype("<i2")),
    "int64": (torch.int64, np.dtype("<i8")),
    "int32": (torch.int32, np.dtype("<i4")),
    "int16": (torch.int16, np.dtype("<i2")),
    "int8": (torch.int8, np.dtype("i1")),
    "uint8": (torch.uint8, np.dtype("u1")),
    "bool": (torch.bool, np.dtype("u1")),
}
_NAMES: dict[torch.dtype, str] = {t: name for name, (t, _) in DTYPES.items()}
_BIG_ENDIAN = sys.byteorder == "big"


class WireError(ValueError):
    """A message or tensor that must not be used. `reason` is a stable tag such as
    "truncated_bytes" or "schema_version"; the message says which field and why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype; `WireError("unknown_dtype")` for unsupported ones."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise WireError("unknown_dtype", f"dtype {dtype} cannot travel on the wire;"
                        f" supported: {', '.join(DTYPES)}") from None


def tensor_to_proto(t: torch.Tensor, out: Any = None) -> pb.Tensor:
    """Encode `t` (any device, any strides) as a `Tensor` message; fills `out` in place when given
    (e.g. `tensor_to_proto(x, msg.rewards)`) so nested fields avoid a second copy."""
    name = dtype_name(t.dtype)
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    elif t.dtype == torch.bool:
        t = t.view(torch.uint8)
    arr = t.numpy()
    if _BIG_ENDIAN:
        arr = arr.astype(DTYPES[name][1], copy=False)
    msg = pb.Tensor() if out is None else out
    msg.dtype = name
    del msg.shape[:]
    msg.shape.extend(t.shape)
    msg.data = arr.tobytes(order="C")
    return msg


def _label(name: str | None) -> str:
    return f"tensor {name!r}" if name else "tensor"


def _fmt_shape(shape: tuple[int | None, ...]) -> str:
    """(2, 3) style, with `*` for wildcard dims of an expected shape."""
    dims = ["*" if d is None else str(d) for d in shape]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


def tensor_from_proto(
    msg: pb.Tensor,
    *,
    max_bytes: int,
    expect_dtype: str | None = None,
    expect_shape: tuple[int | None, ...] | None = None,
    name: str | None = None,
) -> torch.Tensor:
    """Decode and validate a `Tensor` message into a CPU tensor that owns writable memory.

    `expect_shape` entries of None match any size. Every check (dtype, shape, byte count, limits)
    runs before anything is allocated, so a hostile shape cannot exhaust memory.
    """
    what = _label(name)
    data = msg.data
    if len(data) > max_bytes:
        raise WireError("oversized_payload", f"{what}: {len(data)} bytes exceeds the limit of {max_bytes}")
    if msg.dtype not in DTYPES:
        raise WireError("unknown_dtype",
                        f"{what}: unknown dtype {msg.dtype!r}; supported: {', '.join(DTYPES)}")
    torch_dtype, np_dtype = DTYPES[msg.dtype]
    if expect_dtype is not None and msg.dtype != expect_dtype:
        raise WireError("dtype_mismatch", f"{what}: dtype {msg.dtype}, expected {expect_dtype}")

    shape = tuple(int(d) for d in msg.shape)
    if len(shape) > MAX_NDIM:
        raise WireError("shape_overflow", f"{what}: {len(shape)} dimensions, at most {MAX_NDIM} allowed")
    if any(d < 0 for d in shape):
        raise WireError("negative_shape", f"{what}: negative dimension in shape {_fmt_shape(shape)}")
    # Bound the product of the non-zero dims too, so (0, 2**62) is no loophole for later reshapes.
    bound = np_dtype.itemsize
    for d in shape:
        bound *= max(d, 1)
        if bound > max_bytes or bound > _INT64_MAX:
            raise WireError("shape_overflow", f"{what}: shape {_fmt_shape(shape)} {msg.dtype} would need more"
                            f" than the limit of {max_bytes} bytes")
    if expect_shape is not None and (
        len(expect_shape) != len(shape)
        or any(e is not None and e != d for e, d in zip(expect_shape, shape, strict=True))
    ):
        raise WireError("shape_mismatch",
                        f"{what}: shape {_fmt_shape(shape)}, expected {_fmt_shape(expect_shape)}")

    numel = 1
    for d in shape:
        numel *= d
    expected = numel * np_dtype.itemsize
    if len(data) != expected:
        reason = "truncated_bytes" if len(data) < expected else "trailing_bytes"
        raise WireError(reason, f"{what}: {len(data)} bytes for shape {_fmt_shape(shape)} {msg.dtype},"
                        f" expected {expected}")

    # astype always copies: the result owns writable, native-endian memory.
    arr = np.frombuffer(data, dtype=np_dtype, count=numel).astype(np_dtype.newbyteorder("="))
    if msg.dtype == "bool" and numel and int(arr.max()) > 1:
        raise WireError("invalid_bool", f"{what}: bool bytes must be 0 or 1, found {int(arr.max())}")
    t = torch.from_numpy(arr)
    if torch_dtype in (torch.bfloat16, torch.bool):
        t = t.view(torch_dtype)
    return t.reshape(shape)
