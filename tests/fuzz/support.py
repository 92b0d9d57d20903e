"""Shared by the fuzz suites: the case counter printed in the terminal summary, and hostile-input strategies."""

from __future__ import annotations

import os
from collections import Counter, defaultdict

import grpc
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from kvservice.v1 import common_pb2 as cpb

#: (service, rpc) -> status code name -> cases tried.
COUNTS: defaultdict[tuple[str, str], Counter] = defaultdict(Counter)
#: Codes a caller mistake may get. Never UNKNOWN or INTERNAL; UNAVAILABLE would mean the server fail-stopped.
CALLER_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE}
#: (service, rpc, code) -> a few distinct messages, printed with KVSERVICE_FUZZ_VERBOSE=1.
SAMPLES: defaultdict[tuple[str, str, str], set] = defaultdict(set)
VERBOSE = os.environ.get("KVSERVICE_FUZZ_VERBOSE") == "1"
SCALE = float(os.environ.get("KVSERVICE_FUZZ_SCALE", "1"))     # e.g. 20 for a long local run


def fuzz_settings(examples: int) -> settings:
    """Bounded, deadline-free settings; KVSERVICE_FUZZ_SCALE multiplies the example count."""
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])


def call(service: str, rpc: str, fn, request, timeout: float = 30.0, metadata=None):
    """Call fn(request); check the status is one a caller mistake may get, with a message; count the case."""
    try:
        reply = fn(request, timeout=timeout, metadata=metadata)
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        reply, code, details = None, exc.code(), exc.details() or ""
    COUNTS[(service, rpc)][code.name] += 1
    if details and len(SAMPLES[(service, rpc, code.name)]) < 6:
        SAMPLES[(service, rpc, code.name)].add(details[:160])
    assert code in CALLER_CODES, f"{service}.{rpc} answered {code.name}: {details!r}\nrequest: {request!r}"[:4000]
    assert code == grpc.StatusCode.OK or (details and "Traceback" not in details), (code, details)
    # The server built a reply it could not send (the call may have changed state): the reply-size bound failed.
    assert not (code == grpc.StatusCode.RESOURCE_EXHAUSTED and "Sent message larger than max" in details
                and not details.startswith("CLIENT")), f"{service}.{rpc}: {details}"
    return reply


# ---- strategies ------------------------------------------------------------------------------
U64 = 2**64 - 1
U32 = 2**32 - 1
DTYPE_CODES = st.sampled_from([0, 1, 2, 3, 4, 10, 11, 12, 5, 13, 99, 2**31 - 1])
small_or_huge = st.one_of(st.integers(0, 40), st.integers(0, U32), st.sampled_from([U32, 2**31, 2**31 - 1]))
u64 = st.one_of(st.integers(0, 64), st.integers(0, U64), st.sampled_from([U64, 2**63, 2**63 - 1]))
names = st.one_of(st.sampled_from(["", "nope", "x" * 65, "bad name!", "../etc"]), st.text(max_size=80))


#: Shapes whose int64 product wraps to a small count (0, 1, -1) or that NumPy cannot describe even empty.
WRAPPING_SHAPES = st.sampled_from([[2**32, 2**32], [274177, 67280421310721], [2**32 + 1, 2**32 - 1], [2**62, 0],
                                   [2**31, 0, 2**31], [0, 2**63 - 1], [2**63 - 1, 2**63 - 1, 2**63 - 1],
                                   [2**21] * 3 + [2**1]])


@st.composite
def garbage_tensor(draw) -> cpb.Tensor:
    """Any dtype code (known or not), any shape (negative, huge, many dims, products that wrap), any bytes."""
    shape = draw(st.one_of(st.just([]), st.lists(st.integers(-3, 2**40), max_size=10), WRAPPING_SHAPES))
    return cpb.Tensor(dtype=draw(DTYPE_CODES), shape=shape, data=draw(st.binary(max_size=96)))


@st.composite
def mismatched_tensor(draw, dtype: int = cpb.UINT64, itemsize: int = 8) -> cpb.Tensor:
    """A well-typed tensor whose declared shape disagrees with its data by a little or wraps around."""
    n = draw(st.integers(0, 6))
    data = np.arange(1, n + 1, dtype=np.uint64).astype(f"<u{itemsize}" if itemsize == 8 else "<u4").tobytes()
    shape = draw(st.one_of(st.sampled_from([[n + 1], [max(n - 1, 0)], [n, 2], [2, n], [n, 0]]), WRAPPING_SHAPES))
    return cpb.Tensor(dtype=dtype, shape=shape, data=data)


INT_DTYPES = st.sampled_from([np.int32, np.int64, np.uint64])
FLOAT_DTYPES = st.sampled_from([np.float16, np.float32])


@st.composite
def int_tensor(draw, lo: int = -3, hi: int = 70, max_len: int = 8, dtype=None) -> cpb.Tensor:
    """A well-formed integer tensor with mostly small values, sometimes extreme ones, sometimes 2-D."""
    dt = np.dtype(dtype or draw(INT_DTYPES))
    info = np.iinfo(dt)
    n = draw(st.integers(0, max_len))
    vals = draw(st.lists(st.one_of(st.integers(max(lo, info.min), min(hi, info.max)),
                                   st.sampled_from([info.min, info.max, 0])), min_size=n, max_size=n))
    a = np.array(vals, dtype=dt)
    code = {np.dtype(np.int32): cpb.INT32, np.dtype(np.int64): cpb.INT64, np.dtype(np.uint64): cpb.UINT64}[dt]
    shape = [] if draw(st.integers(0, 9)) else draw(st.sampled_from([[n], [1, n], [n, 1], [n + 1]]))
    return cpb.Tensor(dtype=code, shape=shape, data=a.astype(dt.newbyteorder("<")).tobytes())


@st.composite
def float_tensor(draw, shape: tuple[int, ...], dtype: str) -> cpb.Tensor:
    """A float tensor of `shape` (a cache dtype name) holding NaN, inf, huge and normal values."""
    n = int(np.prod(shape))
    vals = draw(st.lists(st.one_of(st.floats(-4, 4), st.sampled_from([np.nan, np.inf, -np.inf, 6e4, -0.0])),
                         min_size=n, max_size=n))
    if dtype == "bfloat16":
        a = (np.array(vals, np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return cpb.Tensor(dtype=cpb.BFLOAT16, shape=list(shape), data=a.tobytes())
    dt = np.dtype(dtype)
    code = {np.dtype(np.float16): cpb.FLOAT16, np.dtype(np.float32): cpb.FLOAT32}[dt]
    with np.errstate(over="ignore"):
        return cpb.Tensor(dtype=code, shape=list(shape), data=np.array(vals, dtype=dt).tobytes())


def mostly(common, rare, rare_in: int = 5):
    """common, and rare about once in rare_in draws (st.one_of does not weight repeated branches)."""
    return st.integers(0, rare_in - 1).flatmap(lambda i: rare if i == 0 else common)


def maybe(strategy, p_none: int = 3):
    """None about once in p_none draws."""
    return st.one_of(st.none(), *([strategy] * (p_none - 1)))


def tensor_or_garbage(strategy, garbage_weight: int = 1):
    return st.one_of(*([strategy] * 4), *([garbage_tensor()] * garbage_weight), mismatched_tensor())
