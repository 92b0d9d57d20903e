"""A Step's request walks one way through the code: from the server's handler (the unary _serve, or the stream's
step_one) through the Limits, the journal and the step service, no file is entered again once the request has
left it (issue 21: the request used to bounce api -> wire -> manager -> api -> limits -> api -> ... , ten returns).

The walk is traced on the serving threads (threading.setprofile): every Python function of kvservice/ entered
with the request among its arguments (the StepRequest, the parser's Received wrapper or its DecodedStep), from
the handler's entry on; consecutive functions of one file are one visit. The parser and the admission
interceptor run before the handler (the transport) and are not part of the walk.
"""

import threading

import pytest

from kvservice.client import BlockManagerClient
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.received import Received
from kvservice.contract.sizing import Sizing
from kvservice.manager.step_input import DecodedStep
from kvservice.server.app import serve
from kvservice.state.journal import Journal, MemoryStore
from kvservice.v1 import block_manager_pb2 as pb

pytestmark = pytest.mark.integration
SPEC = CacheSpec.uniform(2, 2, 8, "float16", 4)
HANDLERS = {("server/servicer.py", "_serve"), ("server/stream.py", "step_one")}


class Walk:
    """Records (file under kvservice/, function) of each call that receives the request while a handler runs (from
    its entry to its return, on its thread), on every thread."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.on = False
        self._lock = threading.Lock()
        self._inside = threading.local()

    def __call__(self, frame, event, arg):
        if event not in ("call", "return"):
            return
        handler = getattr(self._inside, "frame", None)
        if event == "return":
            if frame is handler:
                self._inside.frame = None
            return
        path = frame.f_code.co_filename.replace("\\", "/")
        if not self.on or "/kvservice/" not in path:
            return
        where = (path.rsplit("/kvservice/", 1)[1], frame.f_code.co_name)
        if handler is None:
            if where not in HANDLERS:
                return
            self._inside.frame = frame
        if any(isinstance(v, (pb.StepRequest, Received, DecodedStep)) for v in frame.f_locals.values()):
            with self._lock:
                self.calls.append(where)

    def files(self) -> list[str]:
        """The files the request visits from the handler on, one entry per visit."""
        out: list[str] = []
        for f, _ in self.calls:
            if not out or out[-1] != f:
                out.append(f)
        return out


def _returns(files: list[str]) -> list[str]:
    seen: set[str] = set()
    back = []
    for f in files:
        if f in seen:
            back.append(f)
        seen.add(f)
    return back


@pytest.fixture
def walk():
    w = Walk()
    threading.setprofile(w)
    try:
        yield w
    finally:
        threading.setprofile(None)


@pytest.mark.parametrize("kind", ["unary", "stream"])
def test_a_step_request_never_returns_to_a_file_it_left(walk, kind):
    running = serve("127.0.0.1:0", journal=Journal.recover(MemoryStore()))
    try:
        with BlockManagerClient(f"127.0.0.1:{running.port}") as c:
            c.create_pool("p", SPEC, Sizing(num_slots=256, max_seq_len=256))
            c.step("p", admit=[1, 2, 3], admit_tokens=[5, 9, 2])
            if kind == "unary":
                walk.on = True
                c.step("p", extend=[1, 2, 3], extend_tokens=1, request_id="walk-1")
                walk.on = False
            else:
                with c.step_stream("p") as s:
                    s.step(extend=[1, 2, 3], extend_tokens=1)            # the stream's first reply: full tables
                    walk.on = True
                    s.step(extend=[1, 2, 3], extend_tokens=1)            # a delta
                    walk.on = False
    finally:
        running.stop()
    files = walk.files()
    assert not _returns(files), f"the request went back to {_returns(files)}: {files}"
    handler = "server/servicer.py" if kind == "unary" else "server/stream.py"
    # the layers in order: the handler, the one decoding, the Limits, the journal, the step service
    assert [f for f in files if f in (handler, "manager/step_input.py", "server/limits.py", "state/journal.py",
                                      "manager/api.py")] == [handler, "manager/step_input.py", "server/limits.py",
                                                             "state/journal.py", "manager/api.py"], files


def test_the_walk_finds_a_return():
    """The check itself: a walk that goes back to a file is reported (so the test above can fail)."""
    assert _returns(["a.py", "b.py", "a.py", "c.py"]) == ["a.py"]
    assert _returns(["a.py", "b.py", "c.py"]) == []
