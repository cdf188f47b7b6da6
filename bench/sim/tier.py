"""`superinfer bench tier` (or `python -m bench.sim.tier`): the DRAM prefix-cache tier
(services/scheduler/core/tier.py) in the simulator, against vLLM V1 with a host tier.

The setting is `bench reproduce`'s (its `Ctx`: gh200 calibrated, Qwen2.5-32B, SLOs 5 s / 100 ms,
the clients' max_tokens cap, ≥ 3 seeds): ShareGPT conversations turn by turn, each turn's prompt
the whole history, at the conversation rates it runs. Four systems, prefix caching on in all:
- `lvf + tier`: LVF with `kv_offloading_size` GiB of its DRAM pool as a cache level, which it
  loads, recomputes or splits per request and step by copy time, prefill time and TTFT slack
  (`tier_loads` slo);
- `vllm-v1 + tier`: vLLM V1's scheduler (fcfs: FCFS, recompute preemption) with the same tier
  size on the same DRAM, loading every hit the copy budget holds (`tier_loads` all: what vLLM's
  offloading connector does; no SLO in the decision). Its copies run on the same duplex engine
  as ours, which is kind to it (vLLM copies block by block);
- both with HBM-only prefix caching, for reference.

`compare(ctx)` runs it on a reproduction's context (`bench reproduce` calls it with its own, on
the whole HBM pool); bench/report/tier.py renders the rows; `run(args)` does both standalone
(200 conversations a seed, 30% of the HBM pool).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.live.workload import ChatSpec
from bench.report.rows import mean_rows
from bench.report.tier import SYSTEMS, render
from bench.sim import sweep
from bench.sim.costmodel import num_kv_blocks
from bench.sim import repro_ctx
from bench.sim.repro_ctx import SLOS, Ctx
from shared.config import DEFAULT_BLOCK_SIZE as BLOCK_SIZE

TIER_GIB = 128.0  # of the 400 GB DRAM pool, for both systems
CONV_RATES = (2, 4, 6, 8)  # conversations/s: bench reproduce's CONV_RATES
# The HBM pool's share (None: all of it). At 200 conversations a seed the histories fit the whole
# 144 GB (nothing leaves HBM, the tier is never asked); 30% of it puts them under pressure.
# The reproduction runs its 700 conversations on the whole pool.
HBM_SHARE = 0.3


def jobs(ctx, rates, tier_gib: float = TIER_GIB, hbm_share: float | None = HBM_SHARE, systems=SYSTEMS) -> list[sweep.Job]:
    """Each system at each rate."""
    hbm = None if hbm_share is None else int(num_kv_blocks(ctx.hw, ctx.model, BLOCK_SIZE)[0] * hbm_share)
    return [
        sweep.Job(r, ctx.setup(policy, "duplex", hbm=hbm, enable_prefix_caching=True, kv_offloading_size=tier_gib if tier else 0.0))
        for policy, tier in systems
        for r in rates
    ]  # fmt: skip


def compare(
    ctx, rates=CONV_RATES, tier_gib: float = TIER_GIB, hbm_share: float | None = HBM_SHARE,
    think_s: float | None = None, systems=SYSTEMS,
) -> list[dict]:
    """One row per (system, rate), averaged over the context's seeds (spreads beside), on its
    conversations (`think_s`: seconds from a turn's end to the next turn's arrival, the
    context's own when None). `ctx`: bench.sim.repro_ctx.Ctx. `systems`: some of SYSTEMS only."""
    js = jobs(ctx, rates, tier_gib, hbm_share, systems)
    if think_s is None:
        rows, think_s = ctx.run(js, "conversations"), ChatSpec().think_s
    else:
        chat = ChatSpec(multi_turn=True, think_s=think_s)
        items = {s: sweep.load_items("sharegpt-long", ctx.args.conversations, s, chat=chat) for s in ctx.seeds}
        rows = mean_rows(sweep.sweep_seeds(items, js, *SLOS, num_procs=ctx.args.jobs))
    return [{**r, "think_s": think_s, "hbm_share": hbm_share} for r in rows]


# ---------------------------------------------------------------- standalone


def add_arguments(p: argparse.ArgumentParser) -> None:
    repro_ctx.add_arguments(p)
    p.set_defaults(out=repro_ctx.HERE / "results" / "tier.md", conversations=200)
    p.add_argument("--tier-gib", type=float, default=TIER_GIB, help="kv_offloading_size of both systems (default %(default)s)")
    p.add_argument("--conv-rates", type=sweep._floats, default=list(CONV_RATES), help="conversations/s (default 2,4,6,8)")
    p.add_argument("--hbm-share", type=float, default=HBM_SHARE, help="of the profile's HBM KV pool (default %(default)s)")
    p.add_argument("--think-time", type=float, default=None, help="seconds between turns (default: the reproduction's)")


def run(args: argparse.Namespace) -> int:
    ctx = Ctx(args)
    rows = compare(ctx, args.conv_rates, args.tier_gib, args.hbm_share, args.think_time)
    text = render(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    sweep.write_outputs(rows, args.out.with_suffix(".json"), None, {"tier_gib": args.tier_gib})
    print(text)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.sim.tier", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
