"""The worker's step: one Plan in, one StepResult out, in plan order on one step thread;
a step that raises costs the requests that make it raise, not the worker."""

from __future__ import annotations

import contextlib
import threading
import time

import msgspec
import structlog

from services.worker.faults import Faults
from services.worker.runner import ModelRunner, StepTokens
from services.worker.transfer import Transfer, TransferEngine
from shared import protocol as p

RESET_STEP = -1  # the reset plan's step id: one before any scheduler's first
log = structlog.get_logger()


class StepExecutor:
    """One Plan → one StepResult, in plan order on one step thread.

    Compute waits only for the swap-ins it reads: on CUDA the compute stream waits for their
    event, the host does not. The out-direction copies (swap-outs and eager mirrors) are
    queued with their step, before its compute: they wait for the previous step's compute
    (which wrote their blocks), overlap this one's, and finish before the step is reported.
    The next plan's swap-ins start while this step computes (`prefetch`, called from the
    socket loop when that plan arrives), beside the compute, unless they target a block this
    step's compute reads or writes; then they start with their own step (the block reuse
    rule, services/scheduler/core/blocks.py, part 3)."""

    def __init__(self, runner: ModelRunner, engine: TransferEngine, faults: Faults | None = None) -> None:
        self.runner = runner
        self.engine = engine
        self.faults = faults or Faults()
        # Re-run and isolate a raising step; not under tensor parallelism, where a step run
        # on one rank alone would wait forever in a collective (the scheduler resets instead).
        self.retries = runner.group is None
        self.failed: set[str] = set()  # requests a step failed: skipped until a plan drops them
        self._lock = threading.Lock()  # guards the three fields below and engine.submit
        self._computing_step: int | None = None
        self._computing_blocks: set[int] = set()
        self._prefetched: dict[int, tuple[Transfer, float]] = {}

    def prefetch(self, plan: p.Plan) -> None:
        if not plan.swap_in:
            return
        with self._lock:
            if self._computing_step != plan.step_id - 1:
                return  # the previous step is not computing yet; copy in order later
            if any(h in self._computing_blocks for _, h in plan.swap_in):
                return
            # Not after the compute in flight: it touches none of these blocks.
            transfer = self.engine.submit(plan.swap_in, after_compute=False)
            self._prefetched[plan.step_id] = (transfer, time.perf_counter())

    def try_prefetch(self, plan: p.Plan, log) -> None:
        """`prefetch` from the socket loop: a refusal there is no error (the step submits
        its copies itself, and reports any failure as its result)."""
        try:
            self.prefetch(plan)
        except Exception as e:
            log.warning("prefetch skipped", step_id=plan.step_id, error=str(e))

    def reset_plan(self) -> p.Plan:
        """A plan that computes nothing and drops every request (on every rank)."""
        self.failed.clear()
        return p.Plan(RESET_STEP, drop=self.runner.request_ids())

    def __call__(self, plan: p.Plan, plan_wait_s: float) -> p.StepResult:
        """Execute `plan`. A step that raises is rolled back and re-run once; if it raises
        again, its requests are split in halves until those that raise alone are found: they
        fail (dropped here, reported in `StepResult.failed`), the others are computed. Only a
        step whose copies raise is reported as a `WorkerError`."""
        self.faults.plan_started()
        self.failed.difference_update(plan.drop)
        self.faults.forget(plan.drop)
        if self.failed:  # planned before the scheduler heard of the failure
            plan = msgspec.structs.replace(plan, scheduled=[s for s in plan.scheduled if s.request_id not in self.failed])
        try:
            return self._attempt(plan, plan_wait_s, retry=False)
        except Exception as e:
            if not self.retries:
                raise
            log.warning("step_failed_rerunning", step_id=plan.step_id, error=_describe(e))
        try:
            return self._attempt(plan, plan_wait_s, retry=True)
        except Exception as e:
            log.warning("step_failed_twice_isolating", step_id=plan.step_id, error=_describe(e))
        return self._isolate(plan, plan_wait_s)

    def _attempt(self, plan: p.Plan, plan_wait_s: float, retry: bool) -> p.StepResult:
        """The whole plan; on an exception, its requests are as they were before it."""
        new_ids = [r.request_id for r in plan.new_requests if r.request_id not in self.runner]
        saved = self.runner.checkpoint(plan.scheduled)
        try:
            self.runner.drop(plan.drop)
            self.runner.add_requests(plan.new_requests)
            self.faults.added(plan.new_requests)
            return self._execute(plan, plan_wait_s, lambda: self._compute(plan.scheduled, retry))
        except BaseException:
            self.runner.rollback(saved)
            self.runner.drop(new_ids)  # added again by the re-run
            raise

    def _isolate(self, plan: p.Plan, plan_wait_s: float) -> p.StepResult:
        """The plan's copies and drops, each new request added alone, then its scheduled
        requests in parts: a part that raises is rolled back and halved; a request that
        raises alone is failed."""
        failed: dict[str, str] = {}
        for r in plan.new_requests:
            if r.request_id in self.runner:
                continue
            try:
                self.runner.add_requests([r])
                self.faults.added([r])
            except Exception as e:
                failed[r.request_id] = _describe(e)
        todo = [[s for s in plan.scheduled if s.request_id not in failed]]

        def compute() -> StepTokens:
            out = StepTokens([], [])
            while todo:
                part = todo.pop()
                saved = self.runner.checkpoint(part)
                try:
                    got = self._compute(part, retry=True)
                except Exception as e:
                    self.runner.rollback(saved)
                    if len(part) == 1:
                        failed[part[0].request_id] = _describe(e)
                    else:
                        todo.extend([part[len(part) // 2 :], part[: len(part) // 2]])
                    continue
                _merge(out, got)
            return out

        result = self._execute(plan, plan_wait_s, compute)
        result.failed = failed
        if failed:
            self.runner.drop(list(failed))
            self.failed.update(failed)
            log.error("step_failed_requests", step_id=plan.step_id, failed=failed)
        order = {s.request_id: i for i, s in enumerate(plan.scheduled)}
        pairs = sorted(zip(result.request_ids, result.token_ids), key=lambda x: order[x[0]])
        result.request_ids, result.token_ids = [r for r, _ in pairs], [t for _, t in pairs]
        return result

    def _compute(self, scheduled: list[p.ScheduledRequest], retry: bool) -> StepTokens:
        tokens = self.runner.execute_step(scheduled)
        self.faults.check(scheduled, retry)
        return tokens

    def _execute(self, plan: p.Plan, plan_wait_s: float, compute) -> p.StepResult:
        """The plan's copies around `compute()` (its scheduled part). Copies still running
        when it raises are waited for, so a re-run starts with none in flight."""
        t0 = time.perf_counter()
        swap_in = out = None
        try:
            with self._lock:
                swap_in, started = self._prefetched.pop(plan.step_id, (None, t0))
                if swap_in is None:
                    swap_in = self.engine.submit(plan.swap_in)
                out = self.engine.submit((), plan.swap_out, plan.eager)
                self._computing_step = plan.step_id
                self._computing_blocks = self.runner.blocks_touched(plan.scheduled)
            t1 = time.perf_counter()
            stalled = swap_in.fence_in()
            tokens = compute()
            t2 = time.perf_counter()
            out.wait_out()
        except BaseException:
            for transfer in (swap_in, out):
                if transfer is not None:
                    with contextlib.suppress(Exception):
                        transfer.wait()
            raise
        t3 = time.perf_counter()
        # The compute waited `wait_s` for the swap-ins: on the host (CPU) or on the device
        # (CUDA, inside t2 - t1 either way).
        wait_s = stalled() if plan.swap_in else 0.0
        compute_s = max(0.0, (t2 - t1) - wait_s)
        moved = plan.swap_in or plan.swap_out or plan.eager
        return p.StepResult(
            plan.step_id,
            tokens.request_ids,
            tokens.token_ids,
            p.StepTimings(
                transfer_s=(t3 - started) - compute_s if moved else 0.0,
                compute_s=compute_s,
                transfer_wait_s=wait_s,
                plan_wait_s=plan_wait_s,
            ),
            tokens.logprobs,
            tokens.prompt_logprobs,
        )


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _merge(into: StepTokens, part: StepTokens) -> None:
    into.request_ids += part.request_ids
    into.token_ids += part.token_ids
    into.logprobs.update(part.logprobs)
    into.prompt_logprobs.update(part.prompt_logprobs)
