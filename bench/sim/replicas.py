"""`superinfer bench replicas` (or `python -m bench.sim.replicas`): N scheduler+worker replicas
behind one gateway, in the simulator, under each routing (services/gateway/routing.py).

Each replica is the live scheduler core under its step driver with the cost-model worker of
bench/sim/engine.py (the gh200 profile, Qwen2.5-32B, as `bench reproduce`); the gateway is the
live gateway's `Router` over its `SchedulerLink`s, fed the load reports and prefix-cache events
(services/scheduler/cache_report.py) each replica sends, at most every STATS_MIN_GAP_S as the
service does. Requests are ShareGPT conversations turn by turn (each turn's prompt the whole
history, the next turn `think_s` after the previous one ends), arriving by Poisson at `rate`
conversations/s per replica. Per routing: prompt tokens served from cache (HBM and DRAM
tier), TTFT p50/p90 and attainment, TBT attainment; per run, the gateway's side of the cache
index: events and bytes per second on the report channel, the index's entries and bytes at
its peak, the CPU a pick takes — and what the alternative (an index of what the gateway sent
where) would insert per second.

    python -m bench.sim.replicas --replicas 2,8,32 --rate 1.5,3
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import msgspec

from bench.live import workload
from bench.report.metrics import summarize
from bench.sim import engine, sweep
from bench.sim.costmodel import MODELS, compute_time, load_hardware, num_kv_blocks, transfer_time
from bench.sim.engine import STOP, TOKEN, Clock, InFlight, SimSetup, plan_work, requests_of
from bench.sim.repro_ctx import CHAT, MAX_TOKENS, SLOS
from services.gateway.routing import ROUTINGS, Router
from services.gateway.scheduler_client import SchedulerLink
from services.scheduler.cache_report import CacheReport, core_report
from services.scheduler.core import SchedulerConfig, SchedulerCore
from services.scheduler.driver import Driver
from services.scheduler.service import STATS_MIN_GAP_S
from shared.config import DEFAULT_BLOCK_SIZE, default_pipeline_depth
from shared.protocol import SchedulerStats, StepResult, StepTimings, encode

HERE = Path(__file__).resolve().parents[1]  # bench/
TIER_GIB = 128.0  # of each replica's DRAM pool, as `bench tier`
INT_BYTES = sys.getsizeof(2**62)  # one 64-bit block key as a Python int


class Replica:
    """One scheduler core, its cost-model worker, and the gateway's link to it."""

    def __init__(self, i: int, setup: SimSetup, items: list, num_samples: list[int], cached: list) -> None:
        hw, model, cfg = setup.hardware, setup.model, setup.cfg
        self.setup, self.items, self.num_samples, self.cached = setup, items, num_samples, cached
        self.max_model_len = context_len(setup)
        self.core = SchedulerCore(cfg, setup.num_hbm_blocks, setup.num_dram_blocks, self.max_model_len, model.name)
        depth = setup.pipeline_depth or default_pipeline_depth(on_cpu=not hw.pipeline)
        self.driver = Driver(self.core, self.send, depth)
        self.clock = Clock(hw.pipeline, gap_s=hw.step_gap_s)
        self.link = SchedulerLink(f"replica-{i}", None)
        self.report = CacheReport()
        self.last_report = -1.0
        self.num_report_bytes = self.num_events = 0

    def send(self, plan, step, schedule_s: float) -> InFlight:
        """The cost-model worker (engine.simulate's, without NEO): when the result is back."""
        setup, hw, model = self.setup, self.setup.hardware, self.setup.model
        work, sampled = plan_work(plan, self.items, self.num_samples)
        x = transfer_time(
            hw, model, setup.transfer_mode, len(plan.swap_in), len(plan.swap_out) + len(plan.eager), setup.cfg.block_size
        )
        compute_s = compute_time(hw, model, work)
        prev_end = self.driver.in_flight[-1].end if self.driver.in_flight else step.now
        _, end = self.clock.step(step.now, prev_end, hw.sched_s, compute_s, x.in_s, x.total_s, bool(plan.swap_in))
        last = [STOP if self.num_samples[int(r)] == self.items[int(r)].output_tokens else TOKEN for r in sampled]
        return InFlight(plan.step_id, sampled, last, end, compute_s)

    def next_end(self) -> float:
        return self.driver.in_flight[0].end if self.driver.in_flight else float("inf")

    def maybe_report(self, now: float) -> None:
        """A load report with the cache events since the last, as the service sends one."""
        if now - self.last_report < STATS_MIN_GAP_S:
            return
        self.last_report = now
        events = self.report.core_events(self.core)
        stats = SchedulerStats(
            scheduler_id=self.link.addr, model_name=self.setup.model.name, max_model_len=self.max_model_len,
            block_size=self.setup.cfg.block_size, **core_report(self.core), cache_seq=self.report.seq, cache=events,
        )  # fmt: skip
        if self.link.cache.wants_snapshot:  # the gateway's first report from it
            stats = msgspec.structs.replace(stats, cache=self.report.snapshot())
        if events is not None:
            self.num_report_bytes += len(encode(events))
            self.num_events += sum(map(len, (events.hbm_added, events.hbm_removed, events.dram_added, events.dram_removed)))
        self.link.on_report(stats, now)


def context_len(setup: SimSetup) -> int:
    """A replica's context window: the model's, or its HBM pool where that is smaller."""
    return min(setup.model.max_position, setup.num_hbm_blocks * setup.cfg.block_size)


def fit_context(items: list, max_len: int) -> tuple[list, int]:
    """`items` with each conversation cut before its first turn that does not fit `max_len`
    (prompt and output; a later turn only grows), which the server would refuse with a 400;
    and how many turns were cut."""
    kept, cut_conversation = [], None
    for it in items:
        if it.turn == 0:
            cut_conversation = None
        if cut_conversation is None and it.prompt_tokens + it.output_tokens > max_len:
            cut_conversation = it.conversation
        if cut_conversation is None:
            kept.append(it)
    return kept, len(items) - len(kept)


def simulate(items: list, setup: SimSetup, num_replicas: int, routing: str) -> dict:
    """One run: every conversation of `items` through `num_replicas` replicas of `setup`
    (each turn fits the context window: `fit_context`)."""
    requests = requests_of(items, setup.max_tokens, context_len(setup))
    num_samples, cached = [0] * len(items), [(0, 0)] * len(items)
    replicas = [Replica(i, setup, items, num_samples, cached) for i in range(num_replicas)]
    router, links = Router(routing), [r.link for r in replicas]
    times: list[list[float]] = [[] for _ in items]
    arrived = [it.arrival_s for it in items]
    arrivals = [(it.arrival_s, i) for i, it in enumerate(items) if it.turn == 0]
    heapq.heapify(arrivals)
    pick_s, num_sent_blocks, peak_entries = [], 0, 0
    for r in replicas:
        r.maybe_report(0.0)
    while True:
        back = min(replicas, key=Replica.next_end)
        if arrivals and arrivals[0][0] <= back.next_end():
            now, i = heapq.heappop(arrivals)
            for link in links:
                link.last_seen = now  # every replica is up (its heartbeat)
            req = requests[i]
            t0 = time.perf_counter()
            link = router.pick(links, now, req.prompt_token_ids, None)
            pick_s.append(time.perf_counter() - t0)
            r = replicas[links.index(link)]
            r.core.add_request(req, now)
            link.on_sent(req)
            num_sent_blocks += (len(req.prompt_token_ids) + items[i].output_tokens) // setup.cfg.block_size
        elif back.next_end() < float("inf"):
            r = back
            now, f = r.next_end(), r.driver.in_flight[0]
            _, outputs = r.driver.result(StepResult(f.step_id, f.sampled, f.tokens, StepTimings(compute_s=f.compute_s)), now)
            for out in outputs:
                i = int(out.request_id)
                times[i].append(now)
                if len(times[i]) == 1:
                    cached[i] = (out.num_cached_tokens, out.num_dram_cached_tokens)
                if out.finish_reason is not None and i + 1 < len(items) and items[i + 1].turn > 0:
                    arrived[i + 1] = now + items[i + 1].think_s
                    heapq.heappush(arrivals, (arrived[i + 1], i + 1))
        else:
            break
        r.driver.step(now)
        r.maybe_report(now)
        peak_entries = max(peak_entries, sum(len(link.cache.hbm) + len(link.cache.dram) for link in links))
    if any(r.core.has_unfinished() for r in replicas):
        raise RuntimeError("simulation stuck")
    records = [
        engine._record(replace(it, arrival_s=t0), ts, n)
        for it, t0, ts, (n, _) in zip(items, arrived, times, cached)
    ]
    duration = max(ts[-1] for ts in times if ts) - min(it.arrival_s for it in items)
    s = summarize(records, *SLOS, duration)
    num_prompt = sum(it.prompt_tokens for it in items)
    entries = sum(len(link.cache.hbm) + len(link.cache.dram) for link in links)
    index_bytes = sum(sys.getsizeof(link.cache.hbm) + sys.getsizeof(link.cache.dram) for link in links) + entries * INT_BYTES
    return {
        "replicas": num_replicas,
        "routing": routing,
        "num_requests": s["num_requests"],
        "completed": s["completed"],
        "cached_token_share": sum(n for n, _ in cached) / num_prompt,
        "dram_cached_token_share": sum(d for _, d in cached) / num_prompt,
        "ttft_p50_ms": s["ttft_p50_ms"],
        "ttft_p90_ms": s["ttft_p90_ms"],
        "ttft_attainment": s["ttft_attainment"],
        "tbt_attainment": s["tbt_attainment"],
        "throughput_tok_s": s["output_tok_s"],
        "duration_s": duration,
        # The gateway's side of the cache index (events from the replicas' reports).
        "index_events_per_s": sum(r.num_events for r in replicas) / duration,
        "index_report_bytes_per_s": sum(r.num_report_bytes for r in replicas) / duration,
        "index_peak_entries": peak_entries,
        "index_bytes_per_entry": index_bytes / entries if entries else None,
        "index_peak_mib": peak_entries * (index_bytes / entries if entries else 0) / 2**20,
        # The alternative: an index of what the gateway sent where (each routed prompt's and
        # output's blocks inserted, with no word of what the replicas dropped).
        "sent_index_inserts_per_s": num_sent_blocks / duration,
        "pick_us_mean": 1e6 * sum(pick_s) / len(pick_s),
        "requests_per_replica_max": max(link.num_routed for link in links),
        "requests_per_replica_min": min(link.num_routed for link in links),
    }


def make_setup(hbm_share: float | None, tier_gib: float) -> SimSetup:
    """One gh200 replica as `bench reproduce` runs it (Qwen2.5-32B, its scheduler defaults,
    SLOs 5 s / 100 ms), LVF with prefix caching and a `tier_gib` DRAM tier."""
    hw, model = load_hardware("gh200"), MODELS["qwen2.5-32b"]
    d = hw.defaults
    cfg = SchedulerConfig(
        policy="lvf", max_batched_tokens=d["max_batched_tokens"], max_num_seqs=d["max_num_seqs"],
        xfer_budget=d["xfer_budget"], ttft_slo=SLOS[0], tbt_slo=SLOS[1], enable_prefix_caching=True,
        kv_offloading_size=tier_gib,
    )  # fmt: skip
    hbm = None if hbm_share is None else int(num_kv_blocks(hw, model, DEFAULT_BLOCK_SIZE)[0] * hbm_share)
    return engine.make_setup(hw, model, cfg, "duplex", hbm=hbm, sched_time="model", max_tokens=MAX_TOKENS)


def run_all(args: argparse.Namespace) -> list[dict]:
    setup = make_setup(args.hbm_share, args.tier_gib)
    rows = []
    for n in args.replicas:
        for rate in args.rate:
            num_conv = max(1, round(args.conversations_per_replica * n))
            items = sweep.load_items("sharegpt-long", num_conv, args.seed, chat=CHAT)
            items, num_cut = fit_context(items, context_len(setup))
            bare = workload.draw_arrivals([replace(it, prompt="") for it in items], rate * n, 1.0, args.seed)
            for routing in args.routing:
                t0 = time.perf_counter()
                row = {**simulate(bare, setup, n, routing), "rate_per_replica": rate, "turns_cut": num_cut,
                       "wall_s": time.perf_counter() - t0}  # fmt: skip
                rows.append(row)
                print(
                    f"{n:3d} replicas {rate:g} conv/s each  {routing:12s} cached {row['cached_token_share']:6.1%}  "
                    f"TTFT p50 {row['ttft_p50_ms']:8.0f} p90 {row['ttft_p90_ms']:8.0f} ms  "
                    f"att {row['ttft_attainment']:6.1%}  TBT att {row['tbt_attainment']:6.1%}  "
                    f"index {row['index_peak_entries']} entries ({row['index_peak_mib']:.1f} MiB), "
                    f"{row['index_events_per_s']:.0f} ev/s {row['index_report_bytes_per_s'] / 1e3:.0f} kB/s  "
                    f"pick {row['pick_us_mean']:.0f} us  [{row['wall_s']:.0f} s]",
                    flush=True,
                )
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r["rate_per_replica"] for r in rows})
    panels = {
        "cached_token_share": "prompt tokens from cache", "ttft_p50_ms": "TTFT p50 (ms)", "ttft_p90_ms": "TTFT p90 (ms)",
        "ttft_attainment": "TTFT attainment (5 s)", "tbt_attainment": "TBT attainment (100 ms)",
    }  # fmt: skip
    fig, axes = plt.subplots(len(rates), len(panels), figsize=(18, 3.4 * len(rates)), squeeze=False)
    for ax_row, rate in zip(axes, rates):
        for ax, (key, label) in zip(ax_row, panels.items()):
            for routing in ROUTINGS:
                pts = sorted((r["replicas"], r[key]) for r in rows if r["routing"] == routing and r["rate_per_replica"] == rate)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=routing)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("replicas")
            ax.set_title(f"{label}, {rate:g} conv/s per replica", fontsize=9)
            if not key.endswith("_ms"):
                ax.set_ylim(0, 1.02)
            else:
                ax.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Routing across gh200 replicas (simulated, Qwen2.5-32B, ShareGPT conversations)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=sweep._ints, default=[2, 8, 32], help="replica counts (default 2,8,32)")
    p.add_argument("--rate", type=sweep._floats, default=[1.5, 3.0], help="conversations/s per replica (default 1.5,3)")
    p.add_argument("--routing", type=sweep._strs, default=list(ROUTINGS), help="routings (default: all three)")
    p.add_argument("--conversations-per-replica", type=float, default=60, help="conversations per replica (default %(default)s)")
    p.add_argument("--hbm-share", type=float, default=None, help="of the profile's HBM KV pool (default: all of it)")
    p.add_argument("--tier-gib", type=float, default=TIER_GIB, help="each replica's DRAM tier, GiB (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=HERE / "results" / "replicas.json")
    p.add_argument("--plot", type=Path, default=HERE / "figures" / "replicas.png")
    p.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                   help="run nothing: write --out and --plot from these earlier runs' rows")


def run(args: argparse.Namespace) -> int:
    if args.merge:  # no runs: the rows of earlier ones, in one file and one plot
        rows = [r for path in args.merge for r in json.loads(path.read_text())["rows"]]
    else:
        rows = run_all(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"setting": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    plot(rows, args.plot)
    print(f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.sim.replicas", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
