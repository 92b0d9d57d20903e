"""Small helpers of the worker's service pinned whole: _host (a device array is copied to the host with its get(),
as CuPy's are; a NumPy array is taken as it is) and _count_reasons (kernel reason codes counted by their
documented names, docs/KERNELS.md)."""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.worker.service import _count_reasons, _host


class DeviceArray:
    """A stand-in for a CuPy array: no buffer NumPy can read, a get() that returns the host copy."""

    def __init__(self, host: np.ndarray) -> None:
        self._host, self.gets = host, 0

    def get(self) -> np.ndarray:
        self.gets += 1
        return self._host


def test_a_device_array_is_read_back_with_get_and_a_host_array_is_taken_as_it_is():
    rng = np.random.default_rng()
    host = rng.integers(-99, 99, (3, 4)).astype(np.int32)
    dev = DeviceArray(host)
    got = _host(dev)
    assert dev.gets == 1 and isinstance(got, np.ndarray) and got.dtype == np.int32
    assert np.array_equal(got, host)
    assert _host(host) is host


def test_reasons_are_counted_by_name():
    """Codes 1..6: out_of_bounds, off_lattice, bad_last_page_len, bad_indptr, wrong_index_space, stale_page."""
    assert _count_reasons([]) == {}
    assert _count_reasons([1, 5, 1, 2, 1, 6, 3, 4, 5]) == {"out_of_bounds": 3, "wrong_index_space": 2,
                                                           "off_lattice": 1, "stale_page": 1,
                                                           "bad_last_page_len": 1, "bad_indptr": 1}
    assert _count_reasons(iter([2, 2])) == {"off_lattice": 2}


def _violations(metrics, kernel, layer, reason):
    return metrics.registry.get_sample_value("kvworker_bounds_violations_total",
                                             {"kernel": kernel, "layer": str(layer), "reason": reason})


def test_a_record_is_reported_whole_and_counted_by_reason_with_the_rest_as_stale_pages():
    """WorkerServicer._record(rec, layer, reasons): the reply's ViolationRecord carries the kernel's record (kernel,
    count, row, position, value, reason; "" for none) and the layer; counts_by_reason is the table rules' reasons,
    plus stale_page for what the count has beyond them (the generations' share); each reason is added to
    kvworker_bounds_violations_total{kernel, layer, reason}."""
    import types

    from kvservice.worker.kernel_api import ViolationRecord
    from kvservice.worker.metrics import WorkerMetrics
    from kvservice.worker.service import WorkerServicer

    rng = np.random.default_rng()
    me = types.SimpleNamespace(metrics=WorkerMetrics("p"))
    layer = int(rng.integers(0, 40))
    row, pos, val = (int(x) for x in rng.integers(1, 10**6, 3))
    rec = ViolationRecord("decode_attention", 7, row, pos, -val, "off_lattice")
    got = WorkerServicer._record(me, rec, layer, {"off_lattice": 3, "out_of_bounds": 2})
    assert (got.kernel, got.layer, got.count, got.row, got.position, got.value, got.reason) == \
        ("decode_attention", layer, 7, row, pos, -val, "off_lattice")
    assert dict(got.counts_by_reason) == {"off_lattice": 3, "out_of_bounds": 2, "stale_page": 2}
    assert [_violations(me.metrics, "decode_attention", layer, r) for r in ("off_lattice", "out_of_bounds",
                                                                             "stale_page")] == [3, 2, 2]
    one = WorkerServicer._record(me, ViolationRecord("append_kv", 1, 0, 3, 9, "stale_page"), layer, {})
    assert dict(one.counts_by_reason) == {"stale_page": 1} and _violations(me.metrics, "append_kv", layer,
                                                                           "stale_page") == 1
    same = WorkerServicer._record(me, ViolationRecord("copy_blocks", 2, 0, 1, -4, "out_of_bounds"), layer,
                                  {"out_of_bounds": 2})
    assert dict(same.counts_by_reason) == {"out_of_bounds": 2}
    assert _violations(me.metrics, "copy_blocks", layer, "stale_page") is None
    clean = WorkerServicer._record(me, ViolationRecord("validate_page_table"), layer, {})
    assert (clean.kernel, clean.layer, clean.count, clean.row, clean.position, clean.value, clean.reason,
            dict(clean.counts_by_reason)) == ("validate_page_table", layer, 0, -1, -1, 0, "", {})
    assert _violations(me.metrics, "validate_page_table", layer, "stale_page") is None


def test_a_request_tensor_goes_to_the_device_unless_asked_for_on_the_host():
    """WorkerServicer._tensor(msg, field, ...): by default the checked array is moved with the caches' array module
    (xp.asarray: CuPy on a GPU worker); device=False keeps the host copy (indptr, read on the host). A stand-in array
    module marks what it moved."""
    from kvservice.contract.geometry import CacheSpec
    from kvservice.contract.wire import to_tensor
    from kvservice.v1 import worker_pb2 as wpb
    from kvservice.worker import ops_numpy
    from kvservice.worker.caches import CacheSet
    from kvservice.worker.metrics import WorkerMetrics
    from kvservice.worker.service import WorkerServicer

    class Moved(np.ndarray):
        pass

    class Module:
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def asarray(a):
            return np.asarray(a).view(Moved)

    caches = CacheSet(CacheSpec.uniform(1, 1, 32, "float32", 4), 4, 0, 1, ops_numpy, xp=Module(), guard_bytes=64)
    s = WorkerServicer(caches, WorkerMetrics("p"), {"worker_id": "w", "pool": "p", "backend": "cpu"})
    sm = np.array([3, 9, 1], np.int64)
    req = wpb.AppendKVRequest(slot_mapping=to_tensor(sm))
    dev = s._tensor(req, "slot_mapping", "int64", (None,), "[n]")
    host = s._tensor(req, "slot_mapping", "int64", (None,), "[n]", device=False)
    assert type(dev) is Moved and type(host) is np.ndarray
    assert dev.tolist() == host.tolist() == [3, 9, 1] and host.flags.c_contiguous



def test_a_request_tensor_of_another_dtype_is_named_by_its_dtype_or_number():
    """The wrong dtype is named by its DType name, or by its number when it is none (a newer client's enum value);
    bytes that are no whole number of items are refused naming the field."""

    from kvservice.contract.errors import InvalidArgument
    from kvservice.contract.geometry import CacheSpec
    from kvservice.contract.wire import to_tensor
    from kvservice.v1 import worker_pb2 as wpb
    from kvservice.worker import ops_numpy
    from kvservice.worker.caches import CacheSet
    from kvservice.worker.metrics import WorkerMetrics
    from kvservice.worker.service import WorkerServicer

    caches = CacheSet(CacheSpec.uniform(1, 1, 32, "float32", 4), 4, 0, 1, ops_numpy, guard_bytes=64)
    s = WorkerServicer(caches, WorkerMetrics("p"), {"worker_id": "w", "pool": "p", "backend": "cpu"})
    req = wpb.AppendKVRequest(slot_mapping=to_tensor(np.zeros(3, np.float32)))
    with pytest.raises(InvalidArgument) as e:
        s._tensor(req, "slot_mapping", "int64", (None,), "[n]")
    assert e.value.message == "slot_mapping must be INT64 [n], got FLOAT32"
    req.slot_mapping.dtype = 99
    with pytest.raises(InvalidArgument) as e:
        s._tensor(req, "slot_mapping", "int64", (None,), "[n]")
    assert e.value.message == "slot_mapping must be INT64 [n], got 99"
    req.slot_mapping.CopyFrom(to_tensor(np.zeros(2, np.int64)))
    req.slot_mapping.data = req.slot_mapping.data[:-3]
    with pytest.raises(InvalidArgument) as e:                 # the field is named by the tensor decoder too
        s._tensor(req, "slot_mapping", "int64", (None,), "[n]")
    assert e.value.message == "slot_mapping: 13 bytes is not a whole number of 8-byte items"


class OnDevice(np.ndarray):
    """Stands for a CuPy array: NumPy's functions refuse it (CuPy forbids implicit conversion)."""

    def __array_function__(self, func, types, args, kwargs):
        return NotImplemented


class DeviceModule:
    """Stands for CuPy: NumPy's functions, and asarray moving an array 'to the device' (an OnDevice view)."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def asarray(a):
        return np.asarray(a).view(OnDevice)


def _servicer_on_device():
    from kvservice.contract.geometry import CacheSpec
    from kvservice.worker import ops_numpy
    from kvservice.worker.caches import CacheSet
    from kvservice.worker.metrics import WorkerMetrics
    from kvservice.worker.service import WorkerServicer

    caches = CacheSet(CacheSpec.uniform(1, 1, 32, "float32", 4), 4, 0, 1, ops_numpy, xp=DeviceModule(), guard_bytes=64)
    return WorkerServicer(caches, WorkerMetrics("p"), {"worker_id": "w", "pool": "p", "backend": "cpu"})


@pytest.mark.parametrize(("indptr", "want"), [([0], 0), ([0, 0, 0], 0), ([0, 3, 3, 8], 5), ([0, 2, 1, 4], 3),
                                              ([5, 2], 0)])
def test_a_csr_table_goes_to_the_device_with_its_longest_row_read_on_the_host(indptr, want):
    """WorkerServicer._csr_bounded: indptr is read on the host (device=False: no device read back), the most pages of
    one row (0 for no rows, never negative) taken from it, and indptr, indices and last_page_len are moved to the
    device."""
    from kvservice.contract.wire import to_tensor
    from kvservice.v1 import worker_pb2 as wpb

    s = _servicer_on_device()
    b = len(indptr) - 1
    req = wpb.WorkerValidateRequest(indptr=to_tensor(np.array(indptr, np.int32)),
                                    indices=to_tensor(np.arange(7, dtype=np.int32)),
                                    last_page_len=to_tensor(np.ones(b, np.int32)))
    ip, idx, lpl, max_pages = s._csr_bounded(req)
    assert max_pages == want and type(max_pages) is int
    assert all(type(a) is OnDevice for a in (ip, idx, lpl))
    assert (ip.view(np.ndarray).tolist(), lpl.shape, idx.shape) == (indptr, (b,), (7,))


def test_a_csr_table_without_indptr_entries_or_of_another_dtype_is_refused_by_name():
    from kvservice.contract.errors import InvalidArgument
    from kvservice.contract.wire import to_tensor
    from kvservice.v1 import worker_pb2 as wpb

    s = _servicer_on_device()
    for ip, msg in ((np.zeros(0, np.int32), "indptr must have B + 1 >= 1 entries"),
                    (np.zeros(2, np.int64), "indptr must be INT32 [B + 1], got INT64")):
        req = wpb.WorkerValidateRequest(indptr=to_tensor(ip), indices=to_tensor(np.zeros(0, np.int32)),
                                        last_page_len=to_tensor(np.zeros(0, np.int32)))
        with pytest.raises(InvalidArgument) as e:
            s._csr_bounded(req)
        assert e.value.message == msg
