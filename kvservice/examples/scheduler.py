"""Reference scheduler: continuous batching with chunked prefill, one step per iteration over a StepStream.

Each iteration it frees finished sequences, grows running ones (a prefill chunk
or one decode token), and admits waiting requests first-come first-served while
the batch and the pool's free slots allow. If the manager still answers
RESOURCE_EXHAUSTED it retries without the admissions (counted as refused), and
if decode growth alone does not fit it preempts the youngest sequence
(recompute: it goes back to the queue), as vLLM does. Steps go over one StepStream with
incremental tables by default (the tables it validates are the mirror's, equal to full ones).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import grpc
import numpy as np

from kvservice.client.client import BlockManagerClient
from kvservice.client.codec import ClientError, StepResult
from kvservice.contract.geometry import IndexSpace
from kvservice.contract.pagetable import validate_page_table


@dataclass(frozen=True, slots=True)
class Request:
    seq_id: int
    arrival_step: int
    prompt_len: int      # tokens
    output_len: int      # tokens to generate


@dataclass(frozen=True, slots=True)
class Workload:
    """Synthetic continuous-batching load: Poisson arrivals, log-normal prompt and output lengths."""

    num_requests: int = 200
    arrival_rate: float = 1.5      # mean arrivals per scheduler step
    prompt_mean: int = 256         # tokens (median of the log-normal)
    output_mean: int = 64
    max_len: int = 1024            # prompt + output never exceeds this
    seed: int = 0

    def requests(self) -> list[Request]:
        rng = np.random.default_rng(self.seed)
        gaps = rng.exponential(1.0 / self.arrival_rate, self.num_requests)
        arrivals = np.floor(np.cumsum(gaps)).astype(int)
        prompts = np.clip(rng.lognormal(np.log(self.prompt_mean), 0.8, self.num_requests), 1, self.max_len // 2)
        outputs = np.clip(rng.lognormal(np.log(self.output_mean), 0.7, self.num_requests), 1, self.max_len // 2)
        return [Request(i + 1, int(a), int(p), int(o))
                for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs, strict=True))]


@dataclass
class _Seq:
    req: Request
    num_tokens: int = 0      # tokens held by the manager
    generated: int = 0

    @property
    def prefilling(self) -> bool:
        return self.num_tokens < self.req.prompt_len

    @property
    def done(self) -> bool:
        return self.generated >= self.req.output_len


@dataclass
class Report:
    served: int = 0
    steps: int = 0
    refused_admissions: int = 0
    preemptions: int = 0
    tokens_generated: int = 0
    peak_batch: int = 0
    peak_slots_used: int = 0
    tables_validated: int = 0
    table_violations: int = 0
    step_latency_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    reply_bytes: int = 0         # Step replies received, serialized bytes (streams only)
    delta_replies: int = 0       # of them, incremental ones

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.step_latency_s, q) * 1e3) if self.step_latency_s else 0.0


class ReferenceScheduler:
    """Drives one pool of a manager through a workload.

    max_batch: most sequences scheduled per step. chunk_size: most prompt tokens a
    sequence prefills per step. validate_every: validate the step's tables every
    N steps with the same checker the manager's tests use (0 = never).
    optimistic: admit by batch size alone and let the manager refuse what does
    not fit (each refusal costs one more Step call); otherwise admit only what
    the last reply's free-slot count says fits.
    transport: "deltas" (one StepStream with incremental tables, the default), "stream" (StepStream,
    full tables) or "unary" (one Step RPC per iteration).
    """

    def __init__(self, client: BlockManagerClient, pool: str, max_batch: int = 32, chunk_size: int = 256,
                 validate_every: int = 1, optimistic: bool = False, transport: str = "deltas") -> None:
        if transport not in ("deltas", "stream", "unary"):
            raise ValueError(f"transport must be deltas, stream or unary, got {transport!r}")
        self.client = client
        self.pool = pool
        self.transport = transport
        self.stream = client.step_stream(pool, deltas=transport == "deltas") if transport != "unary" else None
        self.max_batch = max_batch
        self.chunk_size = chunk_size
        self.validate_every = validate_every
        self.optimistic = optimistic
        info = client.get_pool(pool)
        self.page_size = info.plan.page_size
        self.pool_pages = info.plan.pool_pages
        self.num_slots = info.plan.num_slots
        self.spaces = {s.id: IndexSpace(s.id, s.group, s.scale, s.offset, s.upper_bound, tuple(s.layers), s.base)
                       for s in info.plan.index_spaces}

    def _pages(self, n: int) -> int:
        return -(-n // self.page_size)

    def run(self, workload: Workload, progress: object = None) -> Report:
        """Serve every request of the workload; progress(report, waiting, running) is called each step."""
        pending = deque(workload.requests())
        waiting: deque[_Seq] = deque()
        running: list[_Seq] = []
        report = Report()
        free_slots = self.num_slots
        start = time.perf_counter()
        step = 0
        self._reply_bytes = self._delta_replies = 0
        self._counted = None
        while pending or waiting or running:
            while pending and pending[0].arrival_step <= step:
                waiting.append(_Seq(pending.popleft()))
            finished = [s for s in running if s.done]
            running = [s for s in running if not s.done]
            growth = [(s, min(self.chunk_size, s.req.prompt_len - s.num_tokens) if s.prefilling else 1)
                      for s in running]
            need = sum(self._pages(s.num_tokens + k) - self._pages(s.num_tokens) for s, k in growth)
            budget = free_slots + sum(self._pages(s.num_tokens) for s in finished) - need
            admits = self._admissions(waiting, len(running), budget)
            result, admits = self._step_or_shed(finished, growth, admits, running, waiting, report)
            self._advance(finished, growth, admits, running, report)
            free_slots = result.num_free_slots
            report.peak_slots_used = max(report.peak_slots_used, self.num_slots - free_slots)
            report.peak_batch = max(report.peak_batch, len(running))
            if self.validate_every and step % self.validate_every == 0:
                self._validate(result, report)
            step += 1
            report.steps = step
            if progress is not None:
                progress(report, len(waiting) + len(pending), len(running))  # type: ignore[operator]
        report.wall_s = time.perf_counter() - start
        report.reply_bytes, report.delta_replies = self._reply_bytes, self._delta_replies
        return report

    def _admissions(self, waiting: deque[_Seq], num_running: int, budget: int) -> list[tuple[_Seq, int]]:
        """Waiting sequences to admit this step, with their first chunk's tokens, while the batch has room
        and (unless optimistic) the free pages after the running sequences' growth cover their first chunk."""
        admits: list[tuple[_Seq, int]] = []
        while waiting and num_running + len(admits) < self.max_batch:
            first = min(self.chunk_size, waiting[0].req.prompt_len)
            if self._pages(first) > budget and not self.optimistic:
                break
            budget -= self._pages(first)
            admits.append((waiting.popleft(), first))
        return admits

    def _step_or_shed(self, finished: list[_Seq], growth: list[tuple[_Seq, int]], admits: list[tuple[_Seq, int]],
                      running: list[_Seq], waiting: deque[_Seq], report: Report) -> tuple[object, list]:
        """One Step, shedding load until the pool takes it: refused admissions go back to the queue in order,
        then the youngest running sequence is preempted (re-queued from scratch). Returns (reply, admits)."""
        result = None
        while result is None:
            try:
                result = self._step(finished, growth, admits)
            except ClientError as err:
                if err.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                if admits:                       # refused: back to the queue, in order
                    report.refused_admissions += len(admits)
                    waiting.extendleft(s for s, _ in reversed(admits))
                    admits = []
                elif growth:                     # preempt the youngest running sequence
                    victim, _ = growth.pop()
                    running.remove(victim)
                    finished.append(victim)      # its slots are freed by this step
                    waiting.appendleft(_Seq(victim.req))
                    report.preemptions += 1
                else:
                    raise
            report.step_latency_s.append(self._last_latency)
        return result, admits

    @staticmethod
    def _advance(finished: list[_Seq], growth: list[tuple[_Seq, int]], admits: list[tuple[_Seq, int]],
                 running: list[_Seq], report: Report) -> None:
        """What a Step the pool took did: tokens grown and admitted, one output token per decoding sequence."""
        report.served += sum(1 for s in finished if s.done)
        # A step that ends with the whole prompt held yields one output token.
        for s, k in growth:
            s.num_tokens += k
        for s, k in admits:
            s.num_tokens = k
            running.append(s)
        for s in running:
            if not s.prefilling:
                s.generated += 1
                report.tokens_generated += 1

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()

    def _step(self, finished: list[_Seq], growth: list[tuple[_Seq, int]],
              admits: list[tuple[_Seq, int]]) -> StepResult:
        kw = {"free": [s.req.seq_id for s in finished] or None,
              "extend": [s.req.seq_id for s, _ in growth] or None, "extend_tokens": [k for _, k in growth] or None,
              "admit": [s.req.seq_id for s, _ in admits] or None, "admit_tokens": [k for _, k in admits] or None}
        t0 = time.perf_counter()
        try:
            return self.stream.step(**kw) if self.stream is not None else self.client.step(self.pool, **kw)
        finally:
            self._last_latency = time.perf_counter() - t0
            reply = self.stream.last_reply if self.stream is not None else None
            if reply is not None and reply is not self._counted:
                self._counted = reply
                self._reply_bytes += reply.ByteSize()
                self._delta_replies += reply.HasField("delta")

    def _validate(self, result: StepResult, report: Report) -> None:
        for sid, st in result.tables.items():
            if st.table is None or not len(result.seq_ids):
                continue
            r = validate_page_table(st.table, self.spaces[sid], self.page_size,
                                    pool_pages=self.pool_pages)
            report.tables_validated += 1
            report.table_violations += r.num_violations
