"""Tensors on the wire: dtype + shape + raw little-endian C-order bytes, never pickle.

Decoding is the trust boundary: a peer (or a corrupted stream entry) can send any bytes, so every
check runs before memory is allocated, and every failure is a `WireError` whose `reason` is a short
machine-readable tag (for the dead-letter stream and metrics) and whose message names the field.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from services.core.pb import rlfleet_pb2 as pb

if TYPE_CHECKING:  # torch loads only in a process that sends or receives torch tensors
    import torch

# Bumped when the meaning or layout of a field changes; receivers reject any other value.
SCHEMA_VERSION = 1
# torch supports at most 64 dimensions; nothing in rlfleet needs more than a handful.
MAX_NDIM = 16
_INT64_MAX = 2**63 - 1

# wire name -> the little-endian numpy dtype used to (de)serialise it. bfloat16 has no numpy type:
# it travels as its int16 bit pattern (and decodes to that as a numpy array). bool travels as uint8 (0/1).
NP_DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype("<f4"), "float64": np.dtype("<f8"), "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<i2"), "int64": np.dtype("<i8"), "int32": np.dtype("<i4"), "int16": np.dtype("<i2"),
    "int8": np.dtype("i1"), "uint8": np.dtype("u1"), "bool": np.dtype("u1"),
}
_BIG_ENDIAN = sys.byteorder == "big"


def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
            "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
            "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}


class WireError(ValueError):
    """A message or tensor that must not be used. `reason` is a stable tag such as
    "truncated_bytes" or "schema_version"; the message says which field and why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype; `WireError("unknown_dtype")` for unsupported ones."""
    names = {t: name for name, t in _torch_dtypes().items()}
    try:
        return names[dtype]
    except KeyError:
        raise WireError("unknown_dtype", f"dtype {dtype} cannot travel on the wire;"
                        f" supported: {', '.join(NP_DTYPES)}") from None


def tensor_to_proto(t: torch.Tensor, out: Any = None) -> pb.Tensor:
    """Encode `t` (any device, any strides) as a `Tensor` message; fills `out` in place when given
    (e.g. `tensor_to_proto(x, msg.rewards)`) so nested fields avoid a second copy."""
    import torch

    name = dtype_name(t.dtype)
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    elif t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return _encode(t.numpy(), name, out)


def array_to_proto(a: np.ndarray[Any, Any], out: Any = None) -> pb.Tensor:
    """`tensor_to_proto` for a numpy array (bool, or a numeric dtype the wire knows; no bfloat16)."""
    name = "bool" if a.dtype == np.bool_ else a.dtype.name
    if name not in NP_DTYPES or name == "bfloat16":
        raise WireError("unknown_dtype", f"dtype {a.dtype} cannot travel on the wire as a numpy array")
    return _encode(np.ascontiguousarray(a).view(np.uint8) if name == "bool" else np.ascontiguousarray(a), name, out)


def _encode(arr: np.ndarray[Any, Any], name: str, out: Any) -> pb.Tensor:
    if _BIG_ENDIAN:
        arr = arr.astype(NP_DTYPES[name], copy=False)
    msg = pb.Tensor() if out is None else out
    msg.dtype = name
    del msg.shape[:]
    msg.shape.extend(arr.shape)
    msg.data = arr.tobytes(order="C")
    return msg


def _label(name: str | None) -> str:
    return f"tensor {name!r}" if name else "tensor"


def _fmt_shape(shape: tuple[int | None, ...]) -> str:
    """(2, 3) style, with `*` for wildcard dims of an expected shape."""
    dims = ["*" if d is None else str(d) for d in shape]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


def array_from_proto(
    msg: pb.Tensor,
    *,
    max_bytes: int,
    expect_dtype: str | None = None,
    expect_shape: tuple[int | None, ...] | None = None,
    name: str | None = None,
) -> np.ndarray[Any, Any]:
    """Decode and validate a `Tensor` message into a numpy array that owns writable memory (bool as
    bool, bfloat16 as its int16 bits).

    `expect_shape` entries of None match any size. Every check (dtype, shape, byte count, limits)
    runs before anything is allocated, so a hostile shape cannot exhaust memory.
    """
    what = _label(name)
    data = msg.data
    if len(data) > max_bytes:
        raise WireError("oversized_payload", f"{what}: {len(data)} bytes exceeds the limit of {max_bytes}")
    if msg.dtype not in NP_DTYPES:
        raise WireError("unknown_dtype",
                        f"{what}: unknown dtype {msg.dtype!r}; supported: {', '.join(NP_DTYPES)}")
    np_dtype = NP_DTYPES[msg.dtype]
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
    return (arr.view(np.bool_) if msg.dtype == "bool" else arr).reshape(shape)


def __getattr__(name: str) -> Any:
    # DTYPES (wire name -> (torch dtype, numpy dtype)) needs torch: built on first use only.
    if name == "DTYPES":
        return {n: (t, NP_DTYPES[n]) for n, t in _torch_dtypes().items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
