"""The cross-iteration pipeline's stream and event order on CUDA, checked without a device.

The CUDA backend takes its streams and events from a torch.cuda-like module; here that is a
recorder that logs every call in one sequence (the only stand-in in these tests: no device
exists on CPU machines, and the order of the calls is what is checked). The model, the
runner, the executor, the engine and the copies themselves are the real ones, on host pools.

The rules (DESIGN.md, DuplexKV, "Cross-iteration pipeline"):
- step t+1's prefetched swap-ins are queued on the transfer stream while step t computes,
  waiting for nothing that step t's compute stream records;
- the compute of t+1 waits for them on the device (a stream wait on their event), never on
  the host (no synchronize of a swap-in event);
- a step's swap-outs wait, on the device, for the compute of the step before it (the last
  writer of their blocks), and overlap their own step's compute.
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from services.worker.copies import IN, OUT
from services.worker.kv_pool import KVPools, KVSpec
from services.worker.model import LlamaModel
from services.worker.runner import ModelRunner
from services.worker.service import StepExecutor
from services.worker.transfer import TransferEngine
from services.worker.weights import expected_names
from shared import protocol as p
from shared.modelfile import ModelConfig

BLOCK = 16
CFG = ModelConfig(
    name="tiny",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position=512,
    tie_embeddings=True,
)


# ---------------------------------------------------------------- the recorder


class Recorder:
    """torch.cuda's Stream, Event, current_stream and stream(), each call appended to `log`
    as a tuple: ("record", event, stream), ("wait", stream, event), ("on", stream),
    ("host_sync", event), ("stream_sync", stream)."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self._ids = itertools.count()
        self.compute = self.Stream(None, name="compute")

    def Stream(self, device, name: str | None = None) -> RecStream:  # noqa: N802 (torch.cuda's name)
        return RecStream(self, name or f"stream{next(self._ids)}")

    def Event(self, enable_timing: bool = False) -> RecEvent:  # noqa: N802
        return RecEvent(self, f"event{next(self._ids)}", enable_timing)

    def current_stream(self, device=None) -> RecStream:
        return self.compute

    @contextlib.contextmanager
    def stream(self, stream: RecStream):
        self.log.append(("on", stream.name))
        yield


class RecStream:
    cuda_stream = 0

    def __init__(self, rec: Recorder, name: str) -> None:
        self.rec, self.name = rec, name

    def wait_event(self, event: RecEvent) -> None:
        self.rec.log.append(("wait", self.name, event.name))

    def wait_stream(self, other: RecStream) -> None:
        self.rec.log.append(("wait_stream", self.name, other.name))

    def synchronize(self) -> None:
        self.rec.log.append(("stream_sync", self.name))


class RecEvent:
    def __init__(self, rec: Recorder, name: str, timing: bool) -> None:
        self.rec, self.name, self.timing = rec, name, timing
        self.stream: str | None = None

    def record(self, stream: RecStream) -> None:
        self.stream = stream.name
        self.rec.log.append(("record", self.name, stream.name))

    def synchronize(self) -> None:
        self.rec.log.append(("host_sync", self.name))

    def query(self) -> bool:
        return True  # the copies ran on the host when they were queued

    def elapsed_time(self, end: RecEvent) -> float:
        return 0.0


# ---------------------------------------------------------------- a tiny real worker


def tiny_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = CFG.hidden_size, CFG.intermediate_size
    q, kv = CFG.num_heads * CFG.head_dim, CFG.num_kv_heads * CFG.head_dim
    shapes = {
        "embed_tokens": (CFG.vocab_size, hidden),
        "layernorm": (hidden,),
        "norm": (hidden,),
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }
    out = {}
    for name in sorted(expected_names(CFG)):
        shape = next(s for key, s in shapes.items() if f"{key}.weight" in name)
        out[name] = torch.randn(shape, generator=gen) * 0.2 + (1.0 if len(shape) == 1 else 0.0)
    return out


class RecordingRunner(ModelRunner):
    """The real runner; logs ("compute", n) as step n's forward is queued and ("computed", n)
    when it has run, and runs `during_compute` between the two (what the socket loop does
    while a step computes)."""

    def __init__(self, rec: Recorder, *args) -> None:
        super().__init__(*args)
        self.rec = rec
        self.steps = itertools.count()
        self.during_compute = lambda step: None

    def execute_step(self, scheduled):  # what the worker loop calls (`execute` calls it too)
        step = next(self.steps)
        self.rec.log.append(("compute", step))
        self.during_compute(step)
        out = super().execute_step(scheduled)
        self.rec.log.append(("computed", step))
        return out


def tiny_worker():
    rec = Recorder()
    spec = KVSpec(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, BLOCK, torch.float32)
    pools = KVPools(spec, 12, 12, "cpu")
    gen = torch.Generator().manual_seed(1)
    for pool in (pools.hbm, pools.dram):
        pool.copy_(torch.randn(pool.shape, generator=gen))
    engine = TransferEngine(pools, "duplex", "per_block", cuda=rec)
    runner = RecordingRunner(rec, LlamaModel(CFG, tiny_weights()).eval(), CFG, pools.hbm, BLOCK, "cpu")
    return rec, pools, engine, runner, StepExecutor(runner, engine)


def two_plans(next_swap_in: list[tuple[int, int]]) -> tuple[p.Plan, p.Plan]:
    """Step 0 prefills request "a" in HBM blocks 0-1, swaps DRAM 3 into HBM 8 and HBM 5 out
    to DRAM 5; step 1 decodes "a", swaps `next_swap_in` in and HBM 6 out to DRAM 6."""
    prompt = list(range(1, 21))
    new = p.NewRequestData("a", prompt, p.SamplingParams(max_tokens=8, temperature=0.0))
    plan0 = p.Plan(
        0,
        new_requests=[new],
        scheduled=[p.ScheduledRequest("a", 0, len(prompt), block_table=[0, 1])],
        swap_in=[(3, 8)],
        swap_out=[(5, 5)],
    )
    plan1 = p.Plan(
        1, scheduled=[p.ScheduledRequest("a", len(prompt), 1)], swap_in=next_swap_in, swap_out=[(6, 6)]
    )
    return plan0, plan1


def at(log: list[tuple], entry: tuple) -> int:
    return log.index(entry)


def recorded_on(log: list[tuple], stream: str, after: int, before: int) -> list[str]:
    return [e[1] for e in log[after:before] if e[0] == "record" and e[2] == stream]


# ---------------------------------------------------------------- the rules


def test_prefetched_swap_ins_overlap_compute_and_compute_waits_on_the_device():
    rec, pools, engine, runner, execute = tiny_worker()
    plan0, plan1 = two_plans(next_swap_in=[(4, 9)])
    # Plan 1 arrives while step 0 computes: the socket loop prefetches its swap-ins.
    runner.during_compute = lambda step: execute.prefetch(plan1) if step == 0 else None
    execute(plan0, 0.0)
    execute(plan1, 0.0)
    engine.close()
    log = rec.log
    in_stream, out_stream = (engine._backend._streams[d].name for d in (IN, OUT))
    compute0, computed0, compute1 = at(log, ("compute", 0)), at(log, ("computed", 0)), at(log, ("compute", 1))

    # Step 1's swap-ins were queued on the transfer stream during step 0's compute, with no
    # wait at all on that stream (so nothing of step 0's compute holds them back).
    prefetch = [i for i, e in enumerate(log[:compute1]) if e == ("on", in_stream) and i > compute0]
    assert len(prefetch) == 1 and prefetch[0] < computed0
    (in_event1,) = recorded_on(log, in_stream, prefetch[0], compute1)
    assert not [e for e in log[compute0:compute1] if e[0] == "wait" and e[1] == in_stream]

    # Step 0's compute event (recorded on the compute stream after step 0's forward, when
    # step 1's swap-outs are queued) is waited on only after those swap-ins were issued.
    compute0_events = recorded_on(log, "compute", compute0, compute1)
    waits_on_compute0 = [i for i, e in enumerate(log) if e[0] == "wait" and e[2] in compute0_events]
    assert waits_on_compute0 and min(waits_on_compute0) > at(log, ("record", in_event1, in_stream))

    # Step 1's swap-outs wait for step 0's compute, on the out stream (the device).
    assert [log[i][1] for i in waits_on_compute0] == [out_stream]

    # The compute of step 1 waits for the swap-in event on the compute stream, and no host
    # ever synchronizes on a swap-in event.
    assert ("wait", "compute", in_event1) in log[:compute1]
    in_events = {e[1] for e in log if e[0] == "record" and e[2] == in_stream}
    assert not [e for e in log if e[0] == "host_sync" and e[1] in in_events]
    assert not [e for e in log if e[0] == "wait_stream"]

    # And the copies themselves ran: the blocks arrived.
    assert torch.equal(pools.hbm[8], pools.dram[3]) and torch.equal(pools.hbm[9], pools.dram[4])
    assert torch.equal(pools.dram[5], pools.hbm[5]) and torch.equal(pools.dram[6], pools.hbm[6])


def test_swap_in_into_a_block_the_compute_touches_waits_for_that_compute():
    """Plan 1 swaps into HBM block 1, which step 0's compute writes: no prefetch; step 1
    queues the copy itself, after an event that marks the end of step 0's compute."""
    rec, pools, engine, runner, execute = tiny_worker()
    plan0, plan1 = two_plans(next_swap_in=[(4, 1)])
    runner.during_compute = lambda step: execute.prefetch(plan1) if step == 0 else None
    execute(plan0, 0.0)
    execute(plan1, 0.0)
    engine.close()
    log = rec.log
    in_stream = engine._backend._streams[IN].name
    compute0, computed0, compute1 = at(log, ("compute", 0)), at(log, ("computed", 0)), at(log, ("compute", 1))
    assert ("on", in_stream) not in log[compute0:computed0]  # nothing queued during the compute
    compute0_events = set(recorded_on(log, "compute", computed0, compute1))
    in_waits = [e[2] for e in log[computed0:compute1] if e[0] == "wait" and e[1] == in_stream]
    assert in_waits and set(in_waits) <= compute0_events
    # The copy landed before step 1 wrote its token (position 20: slot 4 of block 1).
    keep = [i for i in range(BLOCK) if i != 4]
    assert torch.equal(pools.hbm[1][:, :, keep], pools.dram[4][:, :, keep])
