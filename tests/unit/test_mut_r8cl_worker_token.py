"""WorkerClient's call metadata (kvservice/client/worker_client.py, the class doc): the client's token goes with
every call; the leader epoch is added as ``kvservice-leader-epoch`` only when it is set (0 = none sent), read at
each call when it is a callable. Oracle: the metadata tuples written out by hand (``authorization: Bearer <token>``,
docs/AUTH.md's header), as the recording stub saw them.
"""

from __future__ import annotations

from kvservice.client.worker_client import WorkerClient
from kvservice.v1 import worker_pb2 as wpb
from tests.support_client import QueuedStub

TOKEN = (("authorization", "Bearer wt9"),)


def test_a_workers_token_goes_with_every_call_with_or_without_an_epoch():
    epochs = iter([0, 5, 0])
    with WorkerClient("127.0.0.1:1", "w9", 12.0, token="wt9", leader_epoch=lambda: next(epochs)) as wc:
        wc._stub = stub = QueuedStub(Info=wpb.WorkerStatus(), CheckGuards=wpb.CheckGuardsReply())
        wc.info()
        wc.check_guards()
        wc.info()
    assert [(m, t, md) for m, _, t, md in stub.calls] == [
        ("Info", 12.0, TOKEN), ("CheckGuards", 12.0, (*TOKEN, ("kvservice-leader-epoch", "5"))), ("Info", 12.0, TOKEN)]
    with WorkerClient("127.0.0.1:1", token="wt9") as wc:            # epoch 0: never sent, the token still is
        wc._stub = stub = QueuedStub(CheckGuards=wpb.CheckGuardsReply())
        wc.check_guards()
    assert stub.calls == [("CheckGuards", wpb.CheckGuardsRequest(), 30.0, TOKEN)]
