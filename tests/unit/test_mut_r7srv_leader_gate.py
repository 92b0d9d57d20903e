"""kvservice/server/leader_gate.py LeaderGate.intercept_service: the gate applies to the calls of the service it was
given, whatever that service's name ("/<service>/<method>" is gRPC's method path), and to no other.

A service whose name starts with an "X" checks that the path's service part is read exactly (nothing but the one
leading "/" is taken off). Fakes stand in for the continuation and the call context.
"""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from kvservice.server.leader_gate import LeaderGate


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self) -> None:
        self.aborts: list = []

    def abort(self, code, details):
        self.aborts.append(code)
        raise _Aborted(details)


@pytest.mark.parametrize("service", ["XService.v1.Probe", "x.Probe", "kvtest.Probe"])
def test_the_gate_applies_to_its_own_services_calls_and_no_others(service) -> None:
    gate = LeaderGate(service=service)
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: "served")
    mine = gate.intercept_service(lambda d: handler, SimpleNamespace(method=f"/{service}/Unary"))
    ctx = _Context()
    with pytest.raises(_Aborted):                  # a standby: its own service's calls are refused
        mine.unary_unary("req", ctx)
    assert ctx.aborts == [grpc.StatusCode.UNAVAILABLE]
    other = gate.intercept_service(lambda d: handler, SimpleNamespace(method=f"/{service}X/Unary"))
    assert other is handler                         # another service's calls pass untouched
    assert gate.intercept_service(lambda d: None, SimpleNamespace(method=f"/{service}/Nope")) is None
