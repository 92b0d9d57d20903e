"""A worker refuses, before running the kernel, a DecodeAttention whose float32 reply could not be sent."""

import grpc
import numpy as np
import pytest

from kvservice.client import BlockManagerClient
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.status import error_info
from kvservice.contract.wire import to_tensor
from kvservice.server.app import serve
from kvservice.v1 import worker_pb2 as wpb
from kvservice.v1 import worker_pb2_grpc as wpb_grpc
from kvservice.worker.server import serve_worker

pytestmark = pytest.mark.integration


def test_decode_reply_over_the_limit_is_refused_before_the_kernel():
    manager = serve()
    target = f"127.0.0.1:{manager.port}"
    with BlockManagerClient(target) as c:
        c.create_pool("p", CacheSpec.uniform(1, 1, 32, "float16", 16), Sizing(num_slots=64, max_seq_len=256))
        step = c.step("p", admit=np.arange(1, 9), admit_tokens=np.full(8, 20))
    w = serve_worker(target, "p", "wl", backend="cpu")
    try:
        table = step.for_layer(0).table
        q = np.random.default_rng(2).standard_normal((8, 4, 32)).astype(np.float16)
        req = wpb.DecodeAttentionRequest(layer=0, q=to_tensor(q), indptr=to_tensor(table.indptr.astype(np.int32)),
                                         indices=to_tensor(table.indices.astype(np.int32)),
                                         last_page_len=to_tensor(table.last_page_len.astype(np.int32)))
        reply_bytes = 4 * 8 * 4 * 33 + 256                # out [8, 4, 32] + lse [8, 4], float32, and framing
        w.servicer.max_reply_bytes = reply_bytes - 1
        def kernel_calls():
            return w.servicer.metrics.registry.get_sample_value("kvworker_kernel_duration_seconds_count",
                                                                 {"kernel": "decode_attention"}) or 0
        calls = kernel_calls()
        with grpc.insecure_channel(f"127.0.0.1:{w.port}") as ch:
            stub = wpb_grpc.WorkerStub(ch)
            with pytest.raises(grpc.RpcError) as exc:
                stub.DecodeAttention(req, timeout=10)
            assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error_info(exc.value).reason == "REPLY_TOO_LARGE" and "fewer rows" in exc.value.details()
            assert kernel_calls() == calls                  # no kernel ran
            w.servicer.max_reply_bytes = reply_bytes
            out = stub.DecodeAttention(req, timeout=10)
            assert np.frombuffer(out.out.data, "<f4").shape == (8 * 4 * 32,) and out.ByteSize() <= reply_bytes
            assert kernel_calls() == calls + 1
    finally:
        w.stop()
        manager.stop()
