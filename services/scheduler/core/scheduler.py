"""SchedulerCore: request lifecycle, the per-step policy dispatch, and Plan building.

Pure: no I/O, no clock (`now` is a parameter), so the live service and the simulator
drive the same code.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable

from shared.protocol import AddRequest, NewRequestData, Plan, ScheduledRequest, StepResult, TokenOutput

from .artifact import schedule_artifact
from .baselines import BASELINE_STEPS
from .config import SchedulerConfig
from .fcfs import schedule_fcfs
from .invariants import check_invariants
from .lvf import schedule_lvf
from .memory import Memory
from .queues import RequestHeap
from .request import Request, Status, blocks_for
from .step import Step
from .steptime import SLO_SHARE, StepTimeModel
from .tier import Offloader, num_tier_blocks, plan_loads
from .vlt import lag_key


class Overloaded(ValueError):
    """The waiting queue is full (`max_waiting` requests or `max_waiting_tokens` tokens);
    the request may be retried later."""


def cap_prediction(req: Request) -> float:
    """Without a length predictor a request is expected to run to its cap."""
    return float(req.params.max_tokens)


class SchedulerCore:
    def __init__(
        self,
        cfg: SchedulerConfig,
        num_hbm_blocks: int,
        num_dram_blocks: int,
        max_model_len: int,
        model_name: str = "",
        predictor: Callable[[Request], float] = cap_prediction,
    ):
        """`model_name` salts the prefix cache's block hashes. `predictor`: a new request's
        expected output length (`Request.predicted_output`; the ltr policy ranks by it). The
        simulator passes a noisy one of the true length."""
        self.cfg = cfg
        self.predictor = predictor
        self.max_model_len = max_model_len
        self.memory = Memory(
            num_hbm_blocks, num_dram_blocks, cfg.block_size, cfg.mirrors, cfg.enable_prefix_caching, model_name,
            num_tier_blocks(cfg, num_dram_blocks),
        )
        self.offload = Offloader(self.memory)  # the DRAM tier's copies (tier.py)
        self.requests: dict[str, Request] = {}  # live requests
        self.running: dict[str, Request] = {}
        # Paused requests, twice: by arrival (FCFS family) and by VLT lag key (LVF).
        self.q_waiting = RequestHeap()
        self.num_waiting_tokens = 0  # known tokens of the requests in q_waiting
        self.q_rotary = RequestHeap()
        self.q_first = RequestHeap()  # no token emitted yet
        self.q_emitted = RequestHeap()
        self.pending_drops: list[str] = []
        self.step_id = 0
        self.last_step: Step | None = None
        self.num_left_out = 0  # waiting + rotary requests the last step could have run and did not
        self.num_demand_blocks = 0
        self._seq = itertools.count()
        self.num_preemptions = 0
        self.num_recomputes = 0
        self.num_rotations_out = 0
        self.num_rotations_in = 0
        self.num_finished = 0
        self.num_finished_output_tokens = 0
        self.num_aborted = 0
        self.step_time = StepTimeModel()  # learnt from the worker's reports, for slo_chunking
        self._step_tokens: dict[int, int] = {}  # tokens of each plan in flight

    # ------------------------------------------------------------ requests in

    def add_request(self, req: AddRequest, now: float, admitted: bool = False) -> None:
        """`admitted`: the request was let in before (resumed after a worker loss), so the
        waiting-queue bounds do not apply to it."""
        self._validate(req, admitted)
        slo = req.slo
        r = Request(
            request_id=req.request_id,
            seq=next(self._seq),
            prompt_token_ids=list(req.prompt_token_ids),
            output_token_ids=list(req.output_token_ids),
            params=req.params,
            ttft_slo=slo.ttft_s if slo and slo.ttft_s is not None else self.cfg.ttft_slo,
            tbt_slo=slo.tbt_s if slo and slo.tbt_s is not None else self.cfg.tbt_slo,
            arrival=now,
            max_model_len=self.max_model_len,
            last_token_time=now,
        )
        r.predicted_output = self.predictor(r)
        self.requests[r.request_id] = r
        self._track_demand([r])
        self._enqueue(r)

    def _validate(self, req: AddRequest, admitted: bool) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request {req.request_id!r} is already running")
        if not req.prompt_token_ids:
            raise ValueError("the prompt is empty")
        max_tokens = req.params.max_tokens
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if len(req.output_token_ids) >= max_tokens:
            raise ValueError("the request has already generated max_tokens tokens")
        total = len(req.prompt_token_ids) + max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(req.prompt_token_ids)} tokens) + max_tokens ({max_tokens}) "
                f"exceeds the context window of {self.max_model_len} tokens"
            )
        if blocks_for(total, self.cfg.block_size) > self.memory.hbm.num_blocks:
            raise ValueError(f"prompt + max_tokens ({total} tokens) exceeds the whole KV-cache")
        if admitted:
            return
        num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
        if refusal := self.cfg.admission_refusal(len(self.q_waiting), self.num_waiting_tokens, num_tokens):
            raise Overloaded(refusal)

    def abort_request(self, request_id: str, now: float) -> TokenOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, Status.ABORTED, "abort")
        return TokenOutput(request_id, [], "abort")

    # ------------------------------------------------------------ results in

    def update(self, result: StepResult, now: float) -> list[TokenOutput]:
        """Append sampled tokens and release the blocks the step copied from. Tokens of
        requests that finished or were aborted since their step was planned are ignored."""
        self.memory.step_done(result.step_id)
        num_tokens = self._step_tokens.pop(result.step_id, 0)
        if num_tokens and result.timings.compute_s > 0:
            self.step_time.observe(num_tokens, result.timings.compute_s)
        outputs: list[TokenOutput] = []
        live, logprobs, prompt_logprobs = self.requests, result.logprobs, result.prompt_logprobs
        running = Status.RUNNING
        for request_id, token in zip(result.request_ids, result.token_ids):
            req = live.get(request_id)
            if req is None or req.num_pending == 0:
                continue
            req.num_pending -= 1
            req.output_token_ids.append(token)
            req.last_token_time = now
            params = req.params
            reason = req.finish_check(not params.ignore_eos and token in params.stop_token_ids)
            if reason is not None:
                self._finish(req, Status.FINISHED, reason)
            elif req.status is not running:
                self._enqueue(req)  # its lag key moved
            out = TokenOutput(request_id, [token], reason)
            if len(req.output_token_ids) == 1:
                out.num_cached_tokens = req.num_cached_tokens
                out.num_dram_cached_tokens = req.num_dram_cached_tokens
            if request_id in logprobs:  # only requests that asked have an entry
                out.logprobs = [logprobs[request_id]]
            if request_id in prompt_logprobs:
                out.prompt_logprobs = prompt_logprobs[request_id]
            outputs.append(out)
        return outputs

    def _finish(self, req: Request, status: Status, reason: str) -> None:
        self._dequeue(req)
        self.running.pop(req.request_id, None)
        del self.requests[req.request_id]
        self.memory.release_all(req)
        self.num_demand_blocks -= req.demand_blocks
        req.demand_blocks = 0
        req.status = status
        req.finish_reason = reason
        if req.sent:
            self.pending_drops.append(req.request_id)
        if status is Status.FINISHED:
            self.num_finished += 1
            self.num_finished_output_tokens += len(req.output_token_ids)
        else:
            self.num_aborted += 1

    # ------------------------------------------------------------ the step

    def schedule(self, now: float) -> Plan | None:
        """Plan one step; None when there is nothing to compute, copy, drop or preempt
        (with no sample in flight, None while requests are live would be a bug)."""
        cfg, memory = self.cfg, self.memory
        step = Step(
            step_id=self.step_id,
            now=now,
            tokens_left=cfg.max_batched_tokens,
            prefill_left=self._prefill_cap(now),
            moves_left=cfg.b_xfer,
            seqs_left=cfg.max_num_seqs,
            free_hbm_at_start=memory.hbm.num_free,
            fits_all=self.num_demand_blocks <= memory.hbm.num_blocks,
        )
        memory.register_all(self.running.values())  # blocks filled by earlier steps become hits for this one
        if memory.num_tier_blocks:
            memory.begin_step(step, functools.partial(plan_loads, cfg, memory, self.step_time.fit(), step))
        if cfg.is_lvf and not step.fits_all:
            schedule_lvf(self, step)
        elif cfg.policy == "superinfer-artifact":
            schedule_artifact(self, step)
        elif cfg.policy in BASELINE_STEPS:
            BASELINE_STEPS[cfg.policy](self, step)
        else:
            schedule_fcfs(self, step)
        if cfg.mirrors and self.num_demand_blocks > (cfg.mirror_watermark or 0.0) * memory.hbm.num_blocks:
            memory.mirror(self.running.values(), step)
        if memory.num_tier_blocks:
            self.offload(step)
        self._track_demand(step.scheduled)
        self.last_step = step
        self.num_left_out = len(self.q_waiting) + len(self.q_rotary)
        busy = step.scheduled or step.num_moved or step.num_preempted or self.pending_drops
        return self._build_plan(step) if busy else None

    def _prefill_cap(self, now: float) -> int:
        """Prefill tokens this step may take: the token budget or, with `slo_chunking` while
        requests decode, what keeps the step within their tightest TBT SLO. The cap spends the
        prompts' TTFT slack on the decodes' gaps, so it holds only while every prompt's tokens
        can still be computed at the capped rate before the least slack among them runs out."""
        cfg = self.cfg
        slos = [r.tbt_slo for r in self.running.values() if r.has_emitted] if cfg.caps_prefill else []
        fitted = self.step_time.prefill_cap(len(slos), min(slos)) if slos else None
        if fitted is None or fitted >= cfg.max_batched_tokens:
            return cfg.max_batched_tokens
        prompts = [r for r in self.requests.values() if not r.has_emitted]
        backlog = sum(r.num_known - r.num_computed_tokens for r in prompts)
        slack = min((lag_key(r, cfg) for r in prompts), default=math.inf) - now
        return fitted if backlog / fitted * SLO_SHARE * min(slos) <= slack else cfg.max_batched_tokens

    def _build_plan(self, step: Step) -> Plan:
        new_requests: list[NewRequestData] = []
        scheduled: list[ScheduledRequest] = []
        num_tokens = 0
        for req in step.scheduled:
            if not req.sent:
                req.sent = True
                req.table_reset = False
                new_requests.append(
                    NewRequestData(req.request_id, req.prompt_token_ids, req.params, list(req.output_token_ids))
                )
            scheduled.append(_scheduled_entry(req))
            num_tokens += req.step_new_tokens
        plan = Plan(
            step_id=step.step_id,
            new_requests=new_requests,
            scheduled=scheduled,
            swap_in=step.swap_in,
            swap_out=step.swap_out,
            eager=step.eager,
            drop=self.pending_drops,
        )
        self.pending_drops = []
        self._step_tokens[step.step_id] = num_tokens
        self.step_id += 1
        return plan

    # ------------------------------------------------------------ transitions used by policies (policy.PolicyView)

    def grant(self, req: Request, step: Step, reserve: int = 0, wanted: int | None = None) -> int:  # PolicyView.grant
        num = min(req.num_schedulable() if wanted is None else wanted, step.tokens_left - reserve)
        if num > 1:
            num = min(num, step.prefill_left)
        return max(num, 0)

    def admit(self, req: Request, step: Step, num_new_tokens: int) -> None:
        """WAITING/ROTARY -> RUNNING and schedule its first tokens (capacity checked)."""
        self._dequeue(req)
        if req.status is Status.ROTARY:
            self.memory.swap_in(req, step)
            self.num_rotations_in += 1
            step.num_swapped_in_reqs += 1
        else:
            num_new_tokens = self.memory.attach_prefix(req, num_new_tokens, step)
        req.status = Status.RUNNING
        req.run_start = step.now
        req.num_outputs_at_run_start = len(req.output_token_ids)
        self.running[req.request_id] = req
        if not self.memory.grow(req, num_new_tokens):
            raise AssertionError(f"admitted {req.request_id} without room")
        step.schedule(req, num_new_tokens)
        step.admitted.append(req)

    def preempt(self, req: Request, step: Step, recompute_ok: bool = True) -> bool:
        """RUNNING -> ROTARY by swap where the policy swaps and DRAM and B_xfer allow,
        else -> WAITING by recompute if `recompute_ok`. Never aborts. Returns whether
        `req` was preempted."""
        memory = self.memory
        swappable = self.cfg.swaps and 0 < len(req.hbm_blocks) <= self.cfg.b_xfer
        others = (r for r in self.running.values() if r is not req)
        if swappable and memory.can_swap_out(req, step, others):
            memory.preempt_swap(req, step)
            self.num_rotations_out += 1
        elif recompute_ok:
            memory.preempt_recompute(req)
            step.num_recomputed += 1
            self.num_recomputes += 1
        else:
            return False
        del self.running[req.request_id]
        req.preempted_step = step.step_id
        req.paused_at = step.now
        step.preempted.append(req)
        self.num_preemptions += 1
        self._enqueue(req)
        return True

    def _enqueue(self, req: Request) -> None:
        self._dequeue(req)
        if req.status is Status.ROTARY:
            self.q_rotary.push(req, req.seq)
        else:
            self.q_waiting.push(req, req.seq)
            req.num_waiting_tokens = req.num_tokens
            self.num_waiting_tokens += req.num_tokens
        (self.q_emitted if req.has_emitted else self.q_first).push(req, lag_key(req, self.cfg))

    def _dequeue(self, req: Request) -> None:
        self.num_waiting_tokens -= req.num_waiting_tokens
        req.num_waiting_tokens = 0
        for q in (self.q_waiting, self.q_rotary, self.q_first, self.q_emitted):
            q.remove(req)

    def _track_demand(self, reqs: list[Request]) -> None:
        """Bring `num_demand_blocks` up to date with `reqs`' known tokens (every scheduled
        request, each step: `blocks_for(req.num_known)`, inlined)."""
        bs, change = self.cfg.block_size, 0
        for req in reqs:
            num = -(-(len(req.prompt_token_ids) + len(req.output_token_ids) + req.num_pending) // bs)
            change += num - req.demand_blocks
            req.demand_blocks = num
        self.num_demand_blocks += change

    # ------------------------------------------------------------ introspection

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self.pending_drops)

    def stats(self) -> dict:
        m = self.memory
        return {
            "num_waiting": len(self.q_waiting),
            "num_running": len(self.running),
            "num_rotary": len(self.q_rotary),
            # Queued: left out by the last step (arrivals since have not had their chance yet).
            "num_queued": min(self.num_left_out, len(self.q_waiting) + len(self.q_rotary)),
            "num_hbm_blocks": m.hbm.num_blocks,
            "num_free_hbm_blocks": m.hbm.num_free,
            "num_cached_hbm_blocks": m.hbm.num_cached,
            "num_dram_blocks": m.dram.num_blocks,
            "num_free_dram_blocks": m.dram.num_free,
            "num_demand_blocks": self.num_demand_blocks,
            "num_preemptions": self.num_preemptions,
            "num_recomputes": self.num_recomputes,
            "num_rotations_out": self.num_rotations_out,
            "num_rotations_in": self.num_rotations_in,
            "num_blocks_swapped_in": m.num_swapped_in,
            "num_blocks_swapped_out": m.num_swapped_out,
            "num_blocks_mirrored": m.num_mirrored,
            "num_prefix_queries": m.num_prefix_queries,
            "num_prefix_hits": m.num_prefix_hits,
            "num_tier_blocks": m.num_tier_blocks,
            "num_cached_dram_blocks": m.dram.num_cached if m.num_tier_blocks else 0,
            "num_tier_queries": m.num_tier_queries,
            "num_tier_hits": m.num_tier_hits,
            "num_tier_blocks_loaded": m.num_tier_loaded,
            "num_blocks_offloaded": m.num_offloaded,
            "num_finished": self.num_finished,
            "num_aborted": self.num_aborted,
            "num_steps": self.step_id,
        }

    def check_invariants(self) -> None:
        check_invariants(self)


def _scheduled_entry(req: Request) -> ScheduledRequest:
    entry = ScheduledRequest(
        req.request_id, req.num_computed_tokens - req.step_new_tokens, req.step_new_tokens
    )
    if req.table_reset:
        entry.block_table = list(req.hbm_blocks)
        req.table_reset = False
    elif len(req.hbm_blocks) > req.num_sent_blocks:
        entry.new_block_ids = req.hbm_blocks[req.num_sent_blocks :]
    req.num_sent_blocks = len(req.hbm_blocks)
    return entry

