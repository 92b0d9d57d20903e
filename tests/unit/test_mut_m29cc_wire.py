"""kvservice.v1.Tensor encoding (kvservice/contract/wire.py) against its byte layout in common.proto ("a dense
array: little-endian, C order"; DType numbers; an empty shape means 1-D with the length from the data), built
with struct.pack, never with NumPy's own tobytes. Random non-zero values; errors name the field."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.contract.wire import MAX_DIMS, declared_items, field_array, fill_tensor, from_tensor, to_tensor
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import common_pb2 as cpb

# numpy dtype, DType number (common.proto), struct code of one little-endian item
KINDS = [("int32", 10, "i"), ("int64", 11, "q"), ("uint64", 12, "Q"), ("uint32", 13, "I"), ("float16", 1, "e"),
         ("float32", 3, "f")]


def _values(rng: random.Random, dtype: str, n: int) -> list:
    if dtype.startswith("float"):
        return [rng.choice([-1, 1]) * rng.randint(1, 2000) / 8 for _ in range(n)]
    lo, hi = (1, 2**31 - 1) if dtype == "int32" else (1, 2**32 - 1) if dtype == "uint32" else (1, 2**62)
    return [rng.randint(lo, hi) * (rng.choice([-1, 1]) if dtype.startswith("int") else 1) for _ in range(n)]


@pytest.mark.parametrize(("dtype", "code", "fmt"), KINDS)
def test_arrays_are_little_endian_c_order_bytes_with_their_dtype_number(dtype, code, fmt):
    rng = random.Random(code)
    shape = (rng.randint(2, 4), rng.randint(2, 5), rng.randint(1, 3))
    vals = _values(rng, dtype, int(np.prod(shape)))
    a = np.array(vals, dtype=dtype).reshape(shape)
    want = struct.pack(f"<{len(vals)}{fmt}", *vals)
    for arr in (a, a.astype(np.dtype(dtype).newbyteorder(">")), np.asfortranarray(a)):
        t = to_tensor(arr)
        assert (t.dtype, list(t.shape), t.data) == (code, list(shape), want)
        back = from_tensor(t, "f", kinds="iuf")
        assert back.dtype == np.dtype(dtype) and back.shape == shape and back.tolist() == a.tolist()
    flat = to_tensor(a.ravel())                                  # 1-D: no shape, the length is the data's
    assert (flat.dtype, list(flat.shape), flat.data) == (code, [], want)
    assert from_tensor(flat, "f", kinds="iuf").tolist() == a.ravel().tolist()
    msg = cpb.Tensor(dtype=99, shape=[7], data=b"old")
    fill_tensor(msg, a)
    assert (msg.dtype, list(msg.shape), msg.data) == (code, list(shape), want)
    msg = cpb.Tensor()
    fill_tensor(msg, a.ravel()[::-1])                            # a strided view is written in C order
    assert (msg.dtype, list(msg.shape), msg.data) == (code, [], struct.pack(f"<{len(vals)}{fmt}", *vals[::-1]))


def test_a_1d_tensor_with_its_one_extent_decodes_and_big_endian_bytes_never_leak():
    vals = [3, 70000, 2**31 - 5]
    t = cpb.Tensor(dtype=cpb.INT32, shape=[3], data=struct.pack("<3i", *vals))
    a = from_tensor(t, "f")
    assert a.shape == (3,) and a.tolist() == vals and a.dtype.isnative
    assert from_tensor(cpb.Tensor(dtype=cpb.UINT64, data=struct.pack("<2Q", 2**64 - 1, 5)), "g").tolist() == \
        [2**64 - 1, 5]


def test_a_dtype_override_sends_bfloat16_and_fp8_bit_patterns_as_they_are():
    rng = random.Random(5)
    bits = [rng.randint(1, 2**16 - 1) for _ in range(6)]
    t = to_tensor(np.array(bits, dtype=np.uint16), dtype=cpb.BFLOAT16)
    assert (t.dtype, t.data) == (cpb.BFLOAT16, struct.pack("<6H", *bits))
    assert from_tensor(t, "w", kinds="iuf").tolist() == bits
    raw = bytes(rng.randint(1, 255) for _ in range(5))
    for code in (cpb.FLOAT8_E4M3, cpb.FLOAT8_E5M2):
        t = to_tensor(np.frombuffer(raw, dtype=np.uint8), dtype=code)
        assert (t.dtype, t.data) == (code, raw)
        assert from_tensor(t, "k", kinds="iuf").tobytes() == raw
    for bad in (np.array([1, 2], dtype=np.int8), np.array([True]), np.array([1.5], dtype=np.float64)):
        with pytest.raises(InvalidArgument, match=f"arrays of dtype {bad.dtype} cannot cross the wire"):
            to_tensor(bad)
        with pytest.raises(InvalidArgument, match=f"arrays of dtype {bad.dtype} cannot cross the wire"):
            fill_tensor(cpb.Tensor(), bad)


def test_declared_items_is_the_exact_product_of_the_shape():
    rng = random.Random(8)
    for _ in range(20):
        shape = [rng.choice([0, 1, rng.randint(2, 2**40)]) for _ in range(rng.randint(1, MAX_DIMS))]
        want = 1
        for d in shape:
            want *= d
        assert declared_items(cpb.Tensor(shape=shape), "s") == want
    assert declared_items(cpb.Tensor(), "s") is None
    assert declared_items(cpb.Tensor(shape=[2**63 - 1] * 3), "s") == (2**63 - 1) ** 3       # no wrap-around
    for bad in ([1] * (MAX_DIMS + 1), [3, -2], [-1]):
        with pytest.raises(InvalidArgument) as err:
            declared_items(cpb.Tensor(shape=bad), "admit_seq_ids")
        assert err.value.message == f"admit_seq_ids: bad shape {bad} (at most {MAX_DIMS} dimensions, each >= 0)"


def test_malformed_tensors_are_refused_naming_the_field_and_what_is_wrong():
    cases = [
        (cpb.Tensor(dtype=cpb.INT64, data=b"\x01" * 12), "iu",
         "free_seq_ids: 12 bytes is not a whole number of 8-byte items"),
        (cpb.Tensor(dtype=cpb.INT32, shape=[2, 3], data=b"\x01" * 20), "iu",
         "free_seq_ids: shape [2, 3] declares 6 items but the data holds 5 (20 bytes of INT32)"),
        (cpb.Tensor(dtype=cpb.FLOAT16, data=b"\x01\x02"), "iu", "free_seq_ids: dtype FLOAT16 not allowed here"),
        (cpb.Tensor(dtype=cpb.INT32, data=b"\x01" * 4), "f", "free_seq_ids: dtype INT32 not allowed here"),
        (cpb.Tensor(dtype=cpb.DTYPE_UNSPECIFIED), "iu", "free_seq_ids: dtype DTYPE_UNSPECIFIED is not an array dtype"),
        (cpb.Tensor(dtype=42), "iu", "free_seq_ids: dtype 42 is not an array dtype"),
        (cpb.Tensor(dtype=cpb.INT64, shape=[2**31, 0, 2**29]), "iu",
         "free_seq_ids: shape [2147483648, 0, 536870912] describes more than 2^62 bytes"),
    ]
    for t, kinds, message in cases:
        with pytest.raises(InvalidArgument) as err:
            from_tensor(t, "free_seq_ids", kinds)
        assert err.value.message == message
    # 2^31 x 2^28 x 8 bytes = 2^62: at the bound, an empty array of that shape decodes
    a = from_tensor(cpb.Tensor(dtype=cpb.INT64, shape=[2**31, 0, 2**28]), "f")
    assert a.shape == (2**31, 0, 2**28) and a.size == 0


def test_field_array_reads_a_set_field_and_none_for_an_unset_one():
    rng = random.Random(9)
    ids = [rng.randint(1, 2**62) for _ in range(4)]
    req = pb.StepRequest(pool="p", free_seq_ids=cpb.Tensor(dtype=cpb.INT64, data=struct.pack("<4q", *ids)))
    assert field_array(req, "free_seq_ids").tolist() == ids
    assert field_array(req, "admit_seq_ids") is None
    req.extend_num_tokens.CopyFrom(cpb.Tensor(dtype=cpb.FLOAT32, data=b"\x00" * 4))
    with pytest.raises(InvalidArgument, match=r"^extend_num_tokens: dtype FLOAT32 not allowed here$"):
        field_array(req, "extend_num_tokens")


@pytest.mark.parametrize("declared", [True, False])
def test_on_a_host_whose_byte_order_is_not_the_wires_the_decoded_array_is_native(monkeypatch, declared):
    """common.proto fixes the wire's byte order; NumPy's kernels want native arrays. Here the host is little-endian,
    so a big-endian wire stands in for the little-endian wire seen from a big-endian host: from_tensor gives a
    native array with the wire's values, on the 1-D path (its one extent declared, or none) and the N-D one."""
    import kvservice.contract.wire as wire

    monkeypatch.setitem(wire._TO_NP, cpb.INT64, np.dtype(">i8"))
    vals = [5, -(2**40) - 3, 2**62 + 11, 7, -1, 1234567]
    data = struct.pack(f">{len(vals)}q", *vals)
    t = cpb.Tensor(dtype=cpb.INT64, shape=[len(vals)] if declared else [], data=data)
    a = from_tensor(t, "f")
    assert a.dtype.isnative and a.dtype == np.int64 and a.tolist() == vals
    grid = from_tensor(cpb.Tensor(dtype=cpb.INT64, shape=[2, 3], data=data), "g")
    assert grid.dtype.isnative and grid.tolist() == [vals[:3], vals[3:]]
