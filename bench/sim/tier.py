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

`compare(ctx)` runs it on a reproduction's context, so the lead's reproduction calls it with its
own; `render(rows)` returns the Markdown section; `run(args)` does both standalone.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from bench.live.workload import ChatSpec
from bench.report.rows import LABELS, compare as diff_points, mean_rows, pct
from bench.sim import sweep
from bench.sim.costmodel import num_kv_blocks
from shared.config import DEFAULT_BLOCK_SIZE as BLOCK_SIZE

TIER_GIB = 128.0  # of the 400 GB DRAM pool, for both systems
CONV_RATES = (2, 4, 6, 8)  # conversations/s: bench reproduce's CONV_RATES
# The HBM pool's share, as bench reproduce's PRESSURE cuts it: at the whole 144 GB the
# conversations' KV stays in HBM (nothing leaves it, the tier is never asked).
HBM_SHARE = 0.3
SLOS = (5.0, 0.1)  # TTFT, TBT (s): the reproduction's

SYSTEMS = (("lvf", True), ("fcfs", True), ("lvf", False), ("fcfs", False))


def label(policy: str, tier: bool) -> str:
    return f"{LABELS.get(policy, policy)} + {'tier' if tier else 'HBM only'}"


def jobs(ctx, rates, tier_gib: float = TIER_GIB, hbm_share: float = HBM_SHARE, systems=SYSTEMS) -> list[sweep.Job]:
    """Each system at each rate. Scheduling time is the profile's model, not this machine's wall
    clock (the reproduction's): on a shared host the measured time follows the neighbours' load,
    which differs between runs that the table puts side by side."""
    hbm = int(num_kv_blocks(ctx.hw, ctx.model, BLOCK_SIZE)[0] * hbm_share)
    return [
        sweep.Job(r, replace(ctx.setup(policy, "duplex", hbm=hbm, enable_prefix_caching=True,
                                       kv_offloading_size=tier_gib if tier else 0.0), sched_time="model"))
        for policy, tier in systems
        for r in rates
    ]  # fmt: skip


def compare(
    ctx, rates=CONV_RATES, tier_gib: float = TIER_GIB, hbm_share: float = HBM_SHARE, think_s: float | None = None,
    systems=SYSTEMS,
) -> list[dict]:
    """One row per (system, rate), averaged over the context's seeds (spreads beside), on its
    conversations (`think_s`: seconds from a turn's end to the next turn's arrival, the
    context's own when None). `ctx`: bench.sim.reproduce.Ctx, or anything with its `hw`,
    `model`, `seeds`, `args` (`conversations`, `jobs`), `setup` and `conversations`. `systems`:
    some of SYSTEMS only."""
    js = jobs(ctx, rates, tier_gib, hbm_share, systems)
    if think_s is None:  # not through ctx.run: its job key leaves the tier's size out
        items, think_s = ctx.conversations(), ChatSpec().think_s
    else:
        chat = ChatSpec(multi_turn=True, think_s=think_s)
        items = {s: sweep.load_items("sharegpt-long", ctx.args.conversations, s, chat=chat) for s in ctx.seeds}
    rows = mean_rows(sweep.sweep_seeds(items, js, SLOS[0], SLOS[1], num_procs=ctx.args.jobs))
    return [{**r, "think_s": think_s, "hbm_share": hbm_share} for r in rows]


def render(rows: list[dict]) -> str:
    """The Markdown section: per rate, TTFT and TBT attainment of each system (± the spread over
    the seeds), LVF + tier minus vLLM V1 + tier in points, and what the tier did."""
    rates = sorted({r["rate"] for r in rows})
    tier = next((r["kv_offloading_size"] for r in rows if r["kv_offloading_size"]), 0.0)
    seeds = rows[0].get("seeds", 1) if rows else 0
    share, think = (rows[0].get("hbm_share", 1.0), rows[0].get("think_s", 1.0)) if rows else (1.0, 1.0)
    head = [label(p, t) for p, t in SYSTEMS]
    out = [
        "## The DRAM prefix-cache tier",
        "",
        f"ShareGPT conversations (each turn's prompt the whole history, the next turn {think:g} s after the "
        f"last one ends), Qwen2.5-32B on gh200 with {100 * share:.0f}% of its HBM KV pool, {seeds} seeds; "
        f"tier {tier:g} GiB of the DRAM pool for both systems. Each cell: TTFT / TBT attainment. "
        "Δ: LVF + tier minus vLLM V1 + tier, in points (± the larger spread over the seeds).",
        "",
        "| conv/s | " + " | ".join(head) + " | Δ TTFT | Δ TBT | tier hits (tokens) lvf / vllm-v1 |",
        "|---" * (len(head) + 4) + "|",
    ]
    for rate in rates:
        cells = []
        for p, t in SYSTEMS:
            r = _at(rows, p, rate, t)
            cells.append(f"{pct(r['ttft_attainment'])} / {pct(r['tbt_attainment'])}" if r else "—")
        ours, base = _at(rows, "lvf", rate, True), _at(rows, "fcfs", rate, True)
        if ours and base:
            dt, st = diff_points(ours, base, "ttft_attainment")
            db, sb = diff_points(ours, base, "tbt_attainment")
            delta = [f"{dt:+.1f} (±{st:.1f})", f"{db:+.1f} (±{sb:.1f})"]
            hits = f"{ours['num_tier_hits']:.0f} / {base['num_tier_hits']:.0f}"
        else:
            delta, hits = ["—", "—"], "—"
        out.append(f"| {rate:g} | " + " | ".join(cells + delta + [hits]) + " |")
    out += [
        "",
        "vLLM V1 + tier is vLLM's scheduler with its offloading connector's policy (copy what leaves the "
        "GPU, load every hit); its copies are priced on our duplex engine. LVF's tier decides per request "
        "and step whether to load, recompute or split, from the copy rate, the step-time fit and the TTFT slack.",
    ]
    return "\n".join(out) + "\n"


def _at(rows: list[dict], policy: str, rate: float, tier: bool) -> dict | None:
    try:
        return next(r for r in rows if r["policy"] == policy and r["rate"] == rate and bool(r["kv_offloading_size"]) == tier)
    except StopIteration:
        return None


# ---------------------------------------------------------------- standalone


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bench.sim import reproduce

    reproduce.add_arguments(p)
    p.set_defaults(out=Path(reproduce.HERE) / "results" / "tier.md")
    p.add_argument("--tier-gib", type=float, default=TIER_GIB, help="kv_offloading_size of both systems (default %(default)s)")
    p.add_argument("--conv-rates", type=sweep._floats, default=list(CONV_RATES), help="conversations/s (default 2,4,6,8)")
    p.add_argument("--hbm-share", type=float, default=HBM_SHARE, help="of the profile's HBM KV pool (default %(default)s)")
    p.add_argument("--think-time", type=float, default=None, help="seconds between turns (default: the reproduction's)")


def run(args: argparse.Namespace) -> int:
    from bench.sim import reproduce

    ctx = reproduce.Ctx(args)
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
