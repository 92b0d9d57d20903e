"""StreamRegistry: sessions outlive a call, are bounded in number and expire when idle; open streams are capped."""

import pytest

from kvservice.contract.errors import InvalidArgument, ResourceExhausted
from kvservice.server.stream import StreamRegistry, StreamSession, error_reply
from tests.clocks import ManualClock


def test_a_session_is_found_again_by_its_stream_id():
    reg = StreamRegistry(max_streams=4, clock=ManualClock())
    s = reg.session("a")
    s.last_seq = 7
    assert reg.session("a") is s and reg.session("b") is not s and len(reg) == 2


def test_sessions_beyond_max_streams_drop_the_oldest():
    clock = ManualClock()
    reg = StreamRegistry(max_streams=3, clock=clock)
    first = [reg.session(f"s{i}") for i in range(3)]
    clock.now = 1.0
    reg.session("s0")                          # reopened: now the newest
    reg.session("s3")                          # one too many: s1 (oldest) goes
    assert len(reg) == 3
    assert reg.session("s0") is first[0] and reg.session("s1") is not first[1]


def test_idle_sessions_expire_and_active_ones_do_not():
    clock = ManualClock()
    reg = StreamRegistry(idle_seconds=10.0, clock=clock)
    idle, busy = reg.session("idle"), reg.session("busy")
    for t in (4.0, 8.0, 12.0):
        clock.now = t
        busy.last_used = t                     # what a stream does on every request
    assert reg.session("busy") is busy
    assert reg.session("idle") is not idle     # 12 s without a request: a new, empty session
    assert len(reg) == 2


def test_open_streams_are_capped():
    reg = StreamRegistry(max_active=2)
    assert reg.enter() and reg.enter() and not reg.enter()
    reg.leave()
    assert reg.enter() and reg.active == 2


def test_stream_seq_must_start_at_one_and_not_skip():
    s = StreamSession("x")
    with pytest.raises(InvalidArgument, match="stream_seq must be >= 1"):
        s.check_order(0)
    s.check_order(5)                           # a new session (e.g. after a restart) takes any seq
    s.last_seq = 5
    s.check_order(3)                           # a resend
    s.check_order(6)
    with pytest.raises(InvalidArgument, match="skips ahead") as exc:
        s.check_order(8)
    assert exc.value.metadata["expected"] == "6" and exc.value.reason == "STREAM_SEQ"


def test_error_reply_carries_the_status_of_a_unary_step():
    r = error_reply(4, ResourceExhausted("needs 3 slots, 1 free", needed=3, free=1))
    assert (r.stream_seq, r.error.code, r.error.reason) == (4, 8, "RESOURCE_EXHAUSTED")
    assert dict(r.error.metadata) == {"needed": "3", "free": "1"} and r.error.message == "needs 3 slots, 1 free"



def _served(prefix: bool = False, max_seq_len: int = 128, **api_kw: object):
    """(manager, servicer, send(seq, **step_request fields) -> StepReply) of one stream on pool "p", set up as
    kvservice serve sets up a manager (deferred KV events, memory journal, default Limits)."""
    from kvservice.client.codec import create_pool_request, step_request
    from kvservice.contract.errors import JournalUnavailable
    from kvservice.contract.geometry import CacheSpec
    from kvservice.contract.sizing import Sizing
    from kvservice.manager.api import ManagerAPI
    from kvservice.manager.pools import BlockManager
    from kvservice.server.limits import Limits
    from kvservice.server.metrics import ManagerMetrics
    from kvservice.server.servicer import BlockManagerServicer
    from kvservice.server.stream import step_one
    from kvservice.state.journal import Journal

    m = BlockManager()
    m.events.deferred = True
    api = ManagerAPI(m, **api_kw)
    sv = BlockManagerServicer(api, ManagerMetrics(m), Journal(m), Limits())

    def create(max_len: int) -> None:
        api.CreatePool(create_pool_request("p", CacheSpec.uniform(2, 2, 8, "float16", 4), Sizing(
            num_slots=64, max_seq_len=max_len), prefix_caching=prefix))

    create(max_seq_len)
    session = StreamSession("s")

    def send(seq: int, **kw: object):
        r = step_request("p", **kw)
        r.stream_seq = seq
        return step_one(sv, session, r, JournalUnavailable, lambda s, reply: None)

    return m, sv, send, create, session


def test_stream_steps_publish_their_kv_events_once_journaled():
    """Under serve (deferred KV events), a StepStream request's batch shows once the journal took it, like a
    unary Step's; a refused request shows none."""
    import numpy as np

    from kvservice.core.cache_events import BlockStored

    m, _, send, _, _ = _served(prefix=True)
    sub = m.events.subscribe("p", None, "test")
    prompt = np.random.default_rng(3).integers(1, 1000, 13)
    assert not send(1, admit=[7], admit_tokens=[13], admit_token_ids=prompt).HasField("error")
    (lb,) = sub.poll(0)
    stored = [e for e in lb.batch.events if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) == 3        # 13 tokens, page size 4: 3 full pages
    assert send(2, extend=[99], extend_tokens=[1]).HasField("error")  # unknown sequence: refused
    assert sub.poll(0) == []


def test_cost_check_runs_on_every_request_and_on_a_recreated_pool():
    """Every StepStream request's cost (counts vs max_seq_len, reply bound) is checked, from its one decoding: a
    steady decode loop keeps no cache of it, so a pool recreated under the same name with a smaller
    max_seq_len refuses the same bytes, and nothing changed."""
    m, sv, send, create, _ = _served(max_reply_bytes=1 << 20)
    calls = []
    check = sv.api.check_step_cost
    sv.api.check_step_cost = lambda *a: calls.append(a[0].name) or check(*a)
    assert not send(1, admit=[1, 2], admit_tokens=[30, 9]).HasField("error")
    for seq in range(2, 7):
        r = send(seq, extend=[1, 2], extend_tokens=[3, 1])
        assert not r.HasField("error") and r.stream_seq == seq
    assert len(calls) == 6
    assert m.pool_and_lock("p")[0].sequences()[1].tolist() == [30 + 5 * 3, 9 + 5]
    sv.api.DeletePool(__import__("kvservice.v1.block_manager_pb2", fromlist=["x"]).DeletePoolRequest(pool="p",
                                                                                                       force=True))
    create(2)                                                 # max_seq_len 2 < the 3 tokens of the same bytes
    r = send(7, extend=[1, 2], extend_tokens=[3, 1])
    assert r.error.reason == "OVER_MAX_SEQ_LEN" and len(calls) == 7
    assert m.pool_and_lock("p")[0].num_sequences == 0


def test_a_session_keeps_its_stream_id_and_its_tenant():
    """Sessions are keyed by (tenant, stream id) and remember both: two tenants' streams of one id are two sessions."""
    reg = StreamRegistry(clock=ManualClock())
    a, b = reg.session("s-7", "alice"), reg.session("s-7", "bob")
    assert (a.stream_id, a.tenant) == ("s-7", "alice") and (b.stream_id, b.tenant) == ("s-7", "bob")
    assert a is not b and reg.session("s-7", "alice") is a


def test_stream_requests_are_held_to_the_step_limits():
    """A StepStream request is a Step: the server's Limits apply to it as to a unary Step (LIMIT_EXCEEDED in the
    reply, the stream goes on, nothing changed)."""
    from kvservice.server.limits import Limits

    m, sv, send, _, _ = _served()
    sv.limits = Limits(max_step_sequences=2)
    r = send(1, admit=[1, 2, 3], admit_tokens=[4, 4, 4])
    assert r.error.reason == "LIMIT_EXCEEDED" and r.error.metadata["limit"] == "2", r
    assert m.pool_and_lock("p")[0].num_sequences == 0
    assert not send(2, admit=[1, 2], admit_tokens=[4, 4]).HasField("error")
