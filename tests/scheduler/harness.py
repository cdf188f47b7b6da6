"""A worker stand-in for scheduler tests: it executes Plans on a symbolic KV-cache.

Each HBM/DRAM block holds (logical block index, the token ids written into it), so the
tests see whether a request's KV survives swaps, mirrors and recomputes intact, whether a
plan reuses a block it is still copying, and whether a prefix-cache hit gives a request
blocks that hold exactly its own tokens. Token ids come from a seeded RNG (some are stop
tokens), like sampling would; the requests that sample are the worker's own reading of the
plan (the end of a request's tokens reached), checked against the core's rule (`sampling`).

`Driver` runs a core against it through the real step driver (services/scheduler/driver.py,
the loop of the service, the simulator and the replay), one virtual step of `dt` at a time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from services.scheduler import driver
from services.scheduler.core import SchedulerConfig, SchedulerCore
from services.scheduler.core.step import Step, sampling
from shared.protocol import AddRequest, Plan, SamplingParams, StepResult, TokenOutput

STOP = 2


@dataclass
class WorkerRequest:
    tokens: list[int]
    table: list[int] = field(default_factory=list)
    num_computed: int = 0


class SymbolicWorker:
    def __init__(self, num_hbm_blocks: int, num_dram_blocks: int, block_size: int, seed: int = 0, p_stop: float = 0.0):
        self.block_size = block_size
        self.hbm: list[tuple | None] = [None] * num_hbm_blocks
        self.dram: list[tuple | None] = [None] * num_dram_blocks
        self.reqs: dict[str, WorkerRequest] = {}
        self.rng = random.Random(seed)
        self.p_stop = p_stop
        self.num_plans = 0

    def execute(self, plan: Plan) -> StepResult:
        self.num_plans += 1
        for rid in plan.drop:
            self.reqs.pop(rid, None)
        self._copy(plan)
        for new in plan.new_requests:
            assert new.request_id not in self.reqs, f"{new.request_id} sent twice"
            self.reqs[new.request_id] = WorkerRequest(list(new.prompt_token_ids) + list(new.output_token_ids))
        ids, toks = [], []
        expected = sampling(plan, lambda rid: len(self.reqs[rid].tokens))
        for s in plan.scheduled:
            assert s.request_id not in plan.drop, f"{s.request_id} scheduled and dropped"
            wr = self.reqs[s.request_id]
            fresh = s.block_table is not None or not wr.table  # a whole new table: it may start at a cache hit
            if s.block_table is not None:
                wr.table = list(s.block_table)
            wr.table += s.new_block_ids
            if fresh and s.num_computed_tokens % self.block_size == 0:
                wr.num_computed = s.num_computed_tokens  # _check_kv below checks what it starts from
            assert s.num_computed_tokens == wr.num_computed, (
                f"{s.request_id}: plan computes from {s.num_computed_tokens}, worker has {wr.num_computed}"
            )
            end = s.num_computed_tokens + s.num_new_tokens
            assert s.num_new_tokens > 0 and end <= len(wr.tokens), f"{s.request_id}: computes past its tokens"
            self._check_kv(s.request_id, wr, s.num_computed_tokens)
            self._write_kv(s.request_id, wr, s.num_computed_tokens, end)
            wr.num_computed = end
            if end == len(wr.tokens):
                tok = STOP if self.rng.random() < self.p_stop else self.rng.randrange(3, 1000)
                wr.tokens.append(tok)
                ids.append(s.request_id)
                toks.append(tok)
        assert ids == expected, f"step {plan.step_id}: the worker sampled {ids}, the core's rule says {expected}"
        return StepResult(step_id=plan.step_id, request_ids=ids, token_ids=toks)

    def _copy(self, plan: Plan) -> None:
        out_src = {h for h, _ in plan.swap_out} | {h for h, _ in plan.eager}
        in_dst = {h for _, h in plan.swap_in}
        assert not out_src & in_dst, f"step {plan.step_id}: swap-in into HBM blocks being copied out {out_src & in_dst}"
        in_src = {d for d, _ in plan.swap_in}
        out_dst = {d for _, d in plan.swap_out} | {d for _, d in plan.eager}
        assert not in_src & out_dst, f"step {plan.step_id}: DRAM block read and written {in_src & out_dst}"
        for h, d in plan.swap_out + plan.eager:
            self.dram[d] = self.hbm[h]
        for d, h in plan.swap_in:
            self.hbm[h] = self.dram[d]

    def _check_kv(self, rid: str, wr: WorkerRequest, num_computed: int) -> None:
        bs = self.block_size
        for i in range((num_computed + bs - 1) // bs):
            want = min(bs, num_computed - i * bs)
            got = self.hbm[wr.table[i]]
            expected = (i, tuple(wr.tokens[i * bs : i * bs + want]))
            assert got is not None and (got[0], got[1][:want]) == expected, (
                f"{rid}: KV block {i} (hbm {wr.table[i]}) holds {got}, expected {expected}"
            )

    def _write_kv(self, rid: str, wr: WorkerRequest, start: int, end: int) -> None:
        bs = self.block_size
        assert len(wr.table) * bs >= end, f"{rid}: block table too short for {end} tokens"
        for i in range(start // bs, (end + bs - 1) // bs):
            self.hbm[wr.table[i]] = (i, tuple(wr.tokens[i * bs : min(end, (i + 1) * bs)]))


def make_core(policy: str = "fcfs", num_hbm: int = 64, num_dram: int = 256, max_model_len: int = 2048, **kw):
    cfg = SchedulerConfig(policy=policy, **kw)
    return SchedulerCore(cfg, num_hbm, num_dram, max_model_len)


def add(core: SchedulerCore, rid: str, prompt_len: int, max_tokens: int, now: float = 0.0, **params) -> None:
    # Tokens drawn from a generator seeded by the id (str seeds are hashed stably, unlike hash(),
    # which changes per process): two ids' prompts share no block, so no prefix is cached by chance.
    gen = random.Random(rid)
    prompt = [gen.randrange(10, 510) for _ in range(prompt_len)]
    core.add_request(AddRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, **params)), now)


@dataclass
class Sent:
    """A plan at the symbolic worker, which executed it when it was sent."""

    step_id: int
    plan: Plan
    result: StepResult


class Driver:
    """The real step driver around a core and a `SymbolicWorker`, on a virtual clock: each
    `step()` plans (up to `depth` plans in flight), applies the oldest plan's result `dt`
    later, and checks the invariants after every schedule() and every result."""

    def __init__(self, core: SchedulerCore, seed: int = 0, p_stop: float = 0.0, dt: float = 0.01, depth: int = 1):
        self.core = core
        m = core.memory
        self.worker = SymbolicWorker(m.hbm.num_blocks, m.dram.num_blocks, core.cfg.block_size, seed, p_stop)
        self.driver: driver.Driver[Sent] = driver.Driver(core, self._send, depth)
        self.now = 0.0
        self.dt = dt
        self.outputs: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.plans: list[Plan] = []

    def _send(self, plan: Plan, step: Step, schedule_s: float) -> Sent:
        self.core.check_invariants()
        self.plans.append(plan)
        return Sent(plan.step_id, plan, self.worker.execute(plan))

    def step(self) -> Plan | None:
        """One step of the clock: the plan whose result it applied, None when none was in flight."""
        if self.driver.step(self.now):
            self.core.check_invariants()  # the schedule() call that built no plan
        self.now += self.dt
        if not self.driver.in_flight:
            return None
        sent, outs = self.driver.result(self.driver.in_flight[0].result, self.now)
        self.record(outs)
        self.core.check_invariants()
        return sent.plan

    def record(self, outs: list[TokenOutput]) -> None:
        for o in outs:
            self.outputs.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finish_reason:
                assert o.request_id not in self.finish, f"{o.request_id} finished twice"
                self.finish[o.request_id] = o.finish_reason

    def run(self, max_steps: int = 10_000) -> int:
        for n in range(max_steps):
            if not self.core.has_unfinished():
                return n
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps: {self.core.stats()}")
