"""NumPy arrays <-> kvservice.v1.Tensor (little-endian bytes + dtype + shape)."""

from __future__ import annotations

import numpy as np

from kvservice.contract.errors import InvalidArgument
from kvservice.v1 import common_pb2 as pb

# bfloat16 has no NumPy dtype: it travels as raw uint16 bit patterns.
_TO_NP = {
    pb.INT32: np.dtype("<i4"), pb.INT64: np.dtype("<i8"), pb.UINT64: np.dtype("<u8"), pb.UINT32: np.dtype("<u4"),
    pb.FLOAT16: np.dtype("<f2"), pb.FLOAT32: np.dtype("<f4"), pb.BFLOAT16: np.dtype("<u2"),
    pb.FLOAT8_E4M3: np.dtype("u1"), pb.FLOAT8_E5M2: np.dtype("u1"),
}
_FROM_NP = {np.dtype("int32"): pb.INT32, np.dtype("int64"): pb.INT64, np.dtype("uint64"): pb.UINT64,
            np.dtype("uint32"): pb.UINT32,
            np.dtype("float16"): pb.FLOAT16, np.dtype("float32"): pb.FLOAT32}
#: Float codes whose items NumPy holds as raw unsigned integers (it has no bfloat16 or float8): integer kinds on the
#: host, floats on the wire, so a field that wants integers refuses them by code, not only by NumPy kind.
_RAW_FLOATS = frozenset((pb.BFLOAT16, pb.FLOAT8_E4M3, pb.FLOAT8_E5M2))
MAX_DIMS = 8
MAX_SPAN_BYTES = 2**62


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


def declared_items(t: pb.Tensor, name: str) -> int | None:
    """Elements a Tensor's shape declares (None when the shape is empty: 1-D, length from the data).

    Computed with Python integers, so a hostile shape such as [2^32, 2^32] cannot wrap to a small
    product. InvalidArgument for more than MAX_DIMS dimensions or a negative extent.
    """
    if not t.shape:
        return None
    if len(t.shape) > MAX_DIMS or any(d < 0 for d in t.shape):
        raise InvalidArgument(f"{name}: bad shape {list(t.shape)} (at most {MAX_DIMS} dimensions, each >= 0)")
    n = 1
    for d in t.shape:
        n *= d
    return n


def from_tensor(t: pb.Tensor, name: str, kinds: str = "iu") -> np.ndarray:
    """Decode a Tensor without copying; InvalidArgument naming the field if it is malformed.

    The declared shape is checked against the bytes that came before anything is built from
    it. kinds: allowed NumPy dtype kinds ("iu" integers, "f" floats); without "f", the float codes NumPy holds as
    raw unsigned items (BFLOAT16, FLOAT8_*) are refused too: float data is never read as integers.
    """
    want = _TO_NP.get(t.dtype)
    if want is None:
        raise InvalidArgument(f"{name}: dtype {pb.DType.Name(t.dtype) if t.dtype in pb.DType.values() else t.dtype}"
                              f" is not an array dtype")
    if want.kind not in kinds or ("f" not in kinds and t.dtype in _RAW_FLOATS):
        raise InvalidArgument(f"{name}: dtype {pb.DType.Name(t.dtype)} not allowed here")
    data = t.data                       # each read of a bytes field builds a new object: read it once
    if len(data) % want.itemsize:
        raise InvalidArgument(f"{name}: {len(data)} bytes is not a whole number of {want.itemsize}-byte items")
    items = len(data) // want.itemsize
    shape = t.shape                     # read once too (each read builds a container)
    if len(shape) == 1 and shape[0] == items:
        return np.frombuffer(data, dtype=want) if want.isnative else \
            np.frombuffer(data, dtype=want).astype(want.newbyteorder("="))        # the usual 1-D array
    declared = declared_items(t, name)
    if declared is not None and declared != items:
        raise InvalidArgument(f"{name}: shape {list(t.shape)} declares {declared} items but the data holds {items} "
                              f"({len(data)} bytes of {pb.DType.Name(t.dtype)})")
    a = np.frombuffer(data, dtype=want)
    if declared is not None:
        if not declared:       # empty: NumPy still refuses extents whose non-zero product passes its address space
            span = want.itemsize
            for d in t.shape:
                span *= d or 1
            if span > MAX_SPAN_BYTES:
                raise InvalidArgument(f"{name}: shape {list(t.shape)} describes more than 2^62 bytes")
        a = a.reshape(tuple(t.shape))
    return a if want.isnative else a.astype(want.newbyteorder("="))


def field_array(msg: object, field: str, kinds: str = "iu") -> np.ndarray | None:
    """Decode msg.<field> if it is set, else None."""
    if not msg.HasField(field):  # type: ignore[attr-defined]
        return None
    return from_tensor(getattr(msg, field), field, kinds)
