"""The steady decode loop of bench_manager.bench_stream_breakdown alone (StepStream's server request, stream.step_one,
given the request as the server's parser hands it over (a Received: the message and its bytes), with its reply
serialized, and the client's request bytes and reply parsing), for instruction counts:

    valgrind --tool=callgrind python bench/stream_step_loop.py 256 100    # and 500: (I(500) - I(100)) / 400 per step

Usage: python bench/stream_step_loop.py B STEPS; prints the wall-clock min/p10/p50 of the server request (us).
"""
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_manager import SPEC

from kvservice.client import codec
from kvservice.client.stream_core import StreamCore
from kvservice.contract.errors import JournalUnavailable
from kvservice.contract.received import Received
from kvservice.contract.sizing import Sizing
from kvservice.contract.transport import MAX_MESSAGE_BYTES
from kvservice.events.publish import configure_events
from kvservice.manager.api import ManagerAPI
from kvservice.manager.event_log import EventsConfig
from kvservice.manager.pools import BlockManager
from kvservice.server.limits import Limits
from kvservice.server.metrics import ManagerMetrics
from kvservice.server.servicer import BlockManagerServicer
from kvservice.server.stream import StreamSession, step_one
from kvservice.state.journal import Journal
from kvservice.v1 import block_manager_pb2 as pb

b, steps = int(sys.argv[1]), int(sys.argv[2])
manager = BlockManager()
api = ManagerAPI(manager, max_reply_bytes=MAX_MESSAGE_BYTES, fence=True)
configure_events(manager, EventsConfig())
sv = BlockManagerServicer(api, ManagerMetrics(manager), Journal(manager), Limits())
rng = np.random.default_rng(0)
ctx = rng.integers(256, 1024, b)
total = steps + 10
slots = int((-(-(ctx + 2 * total) // 16)).sum()) + b + 64
ids = np.arange(1, b + 1, dtype=np.uint64)
api.CreatePool(codec.create_pool_request("s", SPEC, Sizing(num_slots=slots, max_seq_len=1024 + 2 * total)))
api.Step(codec.step_request("s", admit=ids, admit_tokens=ctx, tables=False))
session, core = StreamSession("bench"), StreamCore("s", 16, True, "bench")
def observe(seconds, reply, metrics=sv.metrics):
    metrics.observe_reply("Step", seconds, reply)
lat = []
for _ in range(total):
    data = core.request_bytes(None, ids, 1, None, None, True, False, {})
    t0 = time.perf_counter()
    reply = step_one(sv, session, Received(pb.StepRequest.FromString(data), data), JournalUnavailable, observe)
    wire = reply.SerializeToString()
    t1 = time.perf_counter()
    core.result(pb.StepReply.FromString(wire), True, False)
    lat.append(t1 - t0)
a = np.array(lat[10:]) * 1e6
if len(a):
    print(f"B={b} min {a.min():.1f} p10 {np.percentile(a, 10):.1f} p50 {np.percentile(a, 50):.1f} us")
