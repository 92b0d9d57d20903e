"""The one way a kvservice gRPC server is built (kvservice/contract/serving.py), served on loopback with a small
servicer of its own: every method of the service under the service's own name and no other path, undecodable bytes
answered INVALID_ARGUMENT naming the message type (not gRPC's INTERNAL), Step's request kept with its bytes on the
manager's service only, the streaming kinds of the .proto, the message limit and the health service.

Oracles: the service descriptors of the .proto (not the handler table), the bytes sent, gRPC's documented codes."""

from __future__ import annotations

import random

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvservice.contract.received import Received, unwrap
from kvservice.contract.serving import Malformed, grpc_server, lenient_handlers
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import block_manager_pb2_grpc as pb_grpc
from kvservice.v1 import worker_pb2_grpc as wpb_grpc

MANAGER, WORKER = "kvservice.v1.BlockManager", "kvservice.v1.Worker"


class Echoing(pb_grpc.BlockManagerServicer):
    """Echo and EchoStream answer the payload; Step records what it was handed."""

    def __init__(self) -> None:
        self.steps: list[object] = []

    def Echo(self, request, context):
        return pb.EchoReply(payload=request.payload)

    def EchoStream(self, request_iterator, context):
        for item in request_iterator:
            if isinstance(item, Malformed):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad item: {item.type_name}")
            yield pb.EchoReply(payload=item.payload[::-1])

    def Step(self, request, context):
        self.steps.append(request)
        return pb.StepReply()


@pytest.fixture(scope="module")
def served():
    servicer = Echoing()
    server, port, health = grpc_server(MANAGER, servicer, "127.0.0.1:0", max_message_bytes=64 * 1024)
    server.start()
    health.set(MANAGER, health_pb2.HealthCheckResponse.SERVING)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel, servicer
    channel.close()
    server.stop(None)


def _raw(channel: grpc.Channel, path: str, data: bytes) -> bytes:
    return channel.unary_unary(path)(data, timeout=30)


def test_each_method_is_served_under_the_service_name_and_no_other_path(served):
    channel, _ = served
    payload = random.Random(1).randbytes(300)
    assert pb_grpc.BlockManagerStub(channel).Echo(pb.EchoRequest(payload=payload), timeout=30).payload == payload
    for path in ("/None/Echo", "/kvservice.v1.Worker/Echo", "/kvservice.v1.BlockManager2/Echo", "/Echo"):
        with pytest.raises(grpc.RpcError) as err:
            _raw(channel, path, pb.EchoRequest(payload=payload).SerializeToString())
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, path
    with pytest.raises(grpc.RpcError) as err:                  # a method the servicer does not implement
        pb_grpc.BlockManagerStub(channel).GetPool(pb.GetPoolRequest(pool="p"), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_undecodable_bytes_are_refused_invalid_argument_naming_the_message_type(served):
    channel, servicer = served
    garbage = b"\x0a\xff\xff\xff\xff\xff\xff"                       # field 1, a length past the end
    for method, type_name in (("Echo", "kvservice.v1.EchoRequest"), ("Step", "kvservice.v1.StepRequest")):
        with pytest.raises(grpc.RpcError) as err:
            _raw(channel, f"/{MANAGER}/{method}", garbage)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == f"request is not a valid {type_name} message (DecodeError)"
    call = channel.stream_stream(f"/{MANAGER}/EchoStream")
    replies = call(iter([pb.EchoRequest(payload=b"abc").SerializeToString(), garbage]), timeout=30)
    assert pb.EchoReply.FromString(next(replies)).payload == b"cba"
    with pytest.raises(grpc.RpcError) as err:
        next(replies)
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                       "bad item: kvservice.v1.EchoRequest")
    assert servicer.steps == []                                     # nothing malformed reached the servicer


def test_a_step_request_reaches_the_manager_servicer_with_its_bytes(served):
    channel, servicer = served
    req = pb.StepRequest(pool="p", request_id="rid-" + random.Random(2).randbytes(6).hex())
    req.free_seq_ids.data = random.Random(3).randbytes(40)
    data = req.SerializeToString()
    _raw(channel, f"/{MANAGER}/Step", data)
    got = servicer.steps[-1]
    assert isinstance(got, Received) and unwrap(got) == (req, data)


def test_a_request_over_the_message_limit_is_refused(served):
    channel, _ = served
    with pytest.raises(grpc.RpcError) as err:
        pb_grpc.BlockManagerStub(channel).Echo(pb.EchoRequest(payload=bytes(65 * 1024)), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=MANAGER), timeout=30)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(("service", "module"), [(MANAGER, pb_grpc), (WORKER, wpb_grpc)])
def test_the_handlers_follow_the_service_descriptor(service, module):
    from google.protobuf.descriptor_pool import Default
    desc = Default().FindServiceByName(service)
    servicer = getattr(module, desc.name + "Servicer")()
    handlers = lenient_handlers(service, servicer)
    assert sorted(handlers) == sorted(m.name for m in desc.methods)
    rng = random.Random(len(service))
    for m in desc.methods:
        h = handlers[m.name]
        assert (h.request_streaming, h.response_streaming) == (m.client_streaming, m.server_streaming), m.name
        msg_bytes = rng.randbytes(0)                                # the empty message parses as the default
        parsed = h.request_deserializer(msg_bytes)
        if service == MANAGER and m.name in ("Step", "StepStream"):
            assert isinstance(parsed, Received) and unwrap(parsed)[1] == msg_bytes
        else:
            assert not isinstance(parsed, Received | Malformed)
            assert parsed.DESCRIPTOR.full_name == m.input_type.full_name
        bad = h.request_deserializer(b"\xff")
        assert isinstance(bad, Malformed) and bad.type_name == m.input_type.full_name


def test_reflection_lists_the_service_health_and_reflection(served):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    channel, _ = served
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    (reply,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                         timeout=30)
    assert sorted(s.name for s in reply.list_services_response.service) == sorted(
        [MANAGER, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"])


def test_the_receive_limit_holds_on_its_own_for_a_request_whose_reply_would_be_small(served):
    """A Step request over the 64 KiB limit is refused before the servicer sees it, although its reply (empty)
    would fit the send limit: the receive limit is the server's own, not a consequence of the reply's size."""
    channel, servicer = served
    before = len(servicer.steps)
    req = pb.StepRequest(pool="p")
    req.free_seq_ids.data = bytes(65 * 1024)
    with pytest.raises(grpc.RpcError) as err:
        _raw(channel, f"/{MANAGER}/Step", req.SerializeToString())
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and len(servicer.steps) == before
    req.free_seq_ids.data = bytes(60 * 1024)                        # under the limit: it reaches the servicer
    _raw(channel, f"/{MANAGER}/Step", req.SerializeToString())
    assert len(servicer.steps) == before + 1
