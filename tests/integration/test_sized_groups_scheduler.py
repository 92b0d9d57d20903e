"""Gemma 3 27B at 8 x 8,192 tokens (bfloat16, page 16) on a pool whose sliding group is sized to its window
(9.8 GB instead of 33.3 GB): the reference scheduler serves a continuous-batching workload over a real server,
and every Step it sends, admissions above all, is accepted or refused exactly as the reference model
(tests/refmodel.py, per-group slot counts) decides; the refusals come from the sliding group, the smaller one."""

from pathlib import Path

import grpc
import pytest

from kvservice.client import BlockManagerClient
from kvservice.client.codec import ClientError
from kvservice.contract.errors import ResourceExhausted
from kvservice.contract.sizing import Sizing
from kvservice.core.model_config import load_model_cache
from kvservice.examples.scheduler import ReferenceScheduler, Workload
from tests.refmodel import RefPool, Step

from .conftest import ManagerProcess

pytestmark = pytest.mark.integration
CONFIG = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs" / "gemma-3-27b-it.json"


class Recording(ReferenceScheduler):
    """The reference scheduler, noting each Step it sends and whether the manager took it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[dict, str | None, int | None]] = []

    def _step(self, finished, growth, admits):
        kw = {"free": [s.req.seq_id for s in finished], "ext": [(s.req.seq_id, k) for s, k in growth],
              "adm": [(s.req.seq_id, k) for s, k in admits]}
        try:
            r = super()._step(finished, growth, admits)
        except ClientError as err:
            self.log.append((kw, err.message if err.code == grpc.StatusCode.RESOURCE_EXHAUSTED else "other", None))
            raise
        self.log.append((kw, None, int(r.num_free_slots)))
        return r


def test_reference_scheduler_on_a_window_sized_gemma3_pool_decides_as_the_model(tmp_path):
    m = load_model_cache(CONFIG, page_size=16)
    sizing = Sizing(max_batch=8, max_seq_len=8192)
    proc = ManagerProcess(tmp_path, "--no-pools", "--state", "memory")
    try:
        with BlockManagerClient(proc.target, timeout=30) as c:
            c.wait_ready()
            info = c.create_pool("gemma27", m.spec, sizing, ("native",))
            slots = [g.num_slots for g in info.plan.groups]
            windows = [g.sliding_window for g in info.plan.groups]
            assert (windows, slots) == ([1024, 0], [8 * 65 + 2048 // 16, 8 * 512])
            assert info.plan.total_bytes == 9_785_311_232 <= 10 * 10**9
            # optimistic: admit by batch size alone, so that the manager (and the model) decide every admission
            sched = Recording(c, "gemma27", max_batch=8, chunk_size=1024, validate_every=1, optimistic=True)
            try:
                report = sched.run(Workload(num_requests=40, arrival_rate=4.0, prompt_mean=3000, output_mean=200,
                                            max_len=8192, seed=11))
            finally:
                sched.close()
    finally:
        proc.stop()
    assert report.served == 40 and report.table_violations == 0 and report.tables_validated > 100
    model = RefPool(16, windows, slots, 8192)
    decided = {"accepted": 0, "refused": 0, "admissions accepted": 0, "admissions refused": 0}
    for i, (kw, refusal, free) in enumerate(sched.log):
        assert refusal != "other", f"step {i}: {kw}"
        try:
            out = model.step(Step(free=kw["free"], ext=kw["ext"], adm=kw["adm"]))
            want = None
        except ResourceExhausted as err:
            out, want = None, err
        assert (refusal is None) == (want is None), f"step {i} ({kw}): manager {refusal!r}, model {want!r}"
        if refusal is None:
            assert out.num_free == free, f"step {i}: free slots {free} vs the model's {out.num_free}"
        else:
            assert "layer group 0" in refusal             # the sliding group, sized to its window, runs out first
        key = "accepted" if refusal is None else "refused"
        decided[key] += 1
        if kw["adm"]:
            decided[f"admissions {key}"] += 1
    # the run exercised both decisions, admissions included
    admitted = {i for kw, refusal, _ in sched.log if refusal is None for i, _ in kw["adm"]}
    print(f"gemma-3-27b 8 x 8192: {len(sched.log)} Steps, {decided}, preemptions {report.preemptions}")
    assert decided["refused"] > 0 and decided["admissions refused"] > 0 and len(admitted) == 40, decided
