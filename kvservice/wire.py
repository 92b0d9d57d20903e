"""NumPy arrays <-> kvservice.v1.Tensor (little-endian bytes + dtype + shape)."""

from __future__ import annotations

import numpy as np

from .errors import InvalidArgument
from .v1 import common_pb2 as pb

# bfloat16 has no NumPy dtype: it travels as raw uint16 bit patterns.
_TO_NP = {
    pb.INT32: np.dtype("<i4"), pb.INT64: np.dtype("<i8"), pb.UINT64: np.dtype("<u8"),
    pb.FLOAT16: np.dtype("<f2"), pb.FLOAT32: np.dtype("<f4"), pb.BFLOAT16: np.dtype("<u2"),
    pb.FLOAT8_E4M3: np.dtype("u1"),
}
_FROM_NP = {np.dtype("int32"): pb.INT32, np.dtype("int64"): pb.INT64, np.dtype("uint64"): pb.UINT64,
            np.dtype("float16"): pb.FLOAT16, np.dtype("float32"): pb.FLOAT32}
MAX_DIMS = 8


def to_tensor(a: np.ndarray, dtype: int | None = None) -> pb.Tensor:
    """Encode an array (C order, little-endian). dtype overrides the wire dtype (e.g. BFLOAT16 for uint16)."""
    a = np.asarray(a)
    code = dtype if dtype is not None else _FROM_NP.get(a.dtype.newbyteorder("="))
    if code is None:
        raise InvalidArgument(f"arrays of dtype {a.dtype} cannot cross the wire")
    want = _TO_NP[code]
    shape = [] if a.ndim == 1 else list(a.shape)
    return pb.Tensor(dtype=code, shape=shape, data=np.ascontiguousarray(a, dtype=want).tobytes())


def fill_tensor(t: pb.Tensor, a: np.ndarray) -> None:
    """Write a 1-D or N-D array into an existing Tensor field in place (no message copy)."""
    code = _FROM_NP.get(a.dtype.newbyteorder("="))
    if code is None:
        raise InvalidArgument(f"arrays of dtype {a.dtype} cannot cross the wire")
    t.dtype = code
    if a.ndim != 1:
        t.shape[:] = a.shape
    t.data = np.ascontiguousarray(a, dtype=_TO_NP[code]).tobytes()


def from_tensor(t: pb.Tensor, name: str, kinds: str = "iu") -> np.ndarray:
    """Decode a Tensor without copying; InvalidArgument naming the field if it is malformed.

    kinds: allowed NumPy dtype kinds ("iu" integers, "f" floats).
    """
    want = _TO_NP.get(t.dtype)
    if want is None:
        raise InvalidArgument(f"{name}: dtype {pb.DType.Name(t.dtype) if t.dtype in pb.DType.values() else t.dtype}"
                              f" is not an array dtype")
    if want.kind not in kinds:
        raise InvalidArgument(f"{name}: dtype {pb.DType.Name(t.dtype)} not allowed here")
    if len(t.data) % want.itemsize:
        raise InvalidArgument(f"{name}: {len(t.data)} bytes is not a whole number of {want.itemsize}-byte items")
    a = np.frombuffer(t.data, dtype=want)
    if t.shape:
        if len(t.shape) > MAX_DIMS or any(d < 0 for d in t.shape):
            raise InvalidArgument(f"{name}: bad shape {list(t.shape)}")
        if int(np.prod(t.shape, dtype=np.int64)) != a.size:
            raise InvalidArgument(f"{name}: shape {list(t.shape)} does not match {a.size} items")
        a = a.reshape(tuple(t.shape))
    return a.astype(want.newbyteorder("="), copy=False)


def field_array(msg: object, field: str, kinds: str = "iu") -> np.ndarray | None:
    """Decode msg.<field> if it is set, else None."""
    if not msg.HasField(field):  # type: ignore[attr-defined]
        return None
    return from_tensor(getattr(msg, field), field, kinds)
