"""bench/REPRODUCTION.md from the reproduction's rows (bench/sim/reproduce.py runs them)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.report import simlive
from bench.report.discussion import discussion, leads
from bench.report.rows import (
    BASELINES,
    PAPER_STEP,
    PAPER_TABLE1,
    at,
    compare,
    fig1_rows,
    knob_rows,
    name,
    operating_points,
    pct,
    tbt_behind,
    verdict,
)

ROWS_FILE = "reproduction.json"


def _scheduling(st: dict) -> str:
    """How the run timed scheduling: what our core measured per step, or a modelled constant
    (rows written before `bench reproduce` measured it)."""
    if st.get("sched_time") == "measured":
        return (
            "Each step's scheduling takes the time our core's `schedule()` took for it on this machine's CPU, "
            "overlapped with compute (the paper's scheduler took 7.6 ms)."
        )
    return f"Scheduling is modelled at the paper's {st['hardware']['sched_ms']:g} ms per step, overlapped with compute."


def attainment_table(rows: list[dict], label, unit: str = "req/s") -> list[str]:
    """Rates down, one column per series: 'TTFT / TBT' attainment, means over the seeds
    with each one's spread (max - min) in parentheses."""
    names = list(dict.fromkeys(label(r) for r in rows))
    lines = [f"| rate ({unit}) | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for rate in sorted({r["rate"] for r in rows}):
        cells = []
        for n in names:
            r = next((r for r in rows if r["rate"] == rate and label(r) == n), None)
            cells.append("" if r is None else f"{spread_cell(r, 'ttft_attainment')} / {spread_cell(r, 'tbt_attainment')}")
        lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    return lines


def detail_table(rows: list[dict], first: str, label, cached: bool = False) -> list[str]:
    """One row per run; `cached` adds the share of prompt tokens found in the prefix cache."""
    cols = (
        "ttft_attainment",
        "tbt_attainment",
        "throughput_tok_s",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "tbt_p50_ms",
        "tbt_p99_ms",
        "num_preemptions",
        "num_recomputes",
        "xfer_ms_mean",
        "stall_share",
    ) + (("cached_token_share",) if cached else ())
    lines = [
        f"| {first} | TTFT att. | TBT att. | tok/s | TTFT p50 ms | TTFT p99 ms | TBT p50 ms | TBT p99 ms | preempt. | recomp. | "
        "copy ms/step | stall |" + (" cached |" if cached else ""),
        "|---|" + "---:|" * len(cols),
    ]
    for r in rows:
        vals = [
            pct(r[c])
            if "attainment" in c
            else f"{100 * r[c]:.2f}%"
            if c == "stall_share"
            else f"{100 * r[c]:.0f}%"
            if c == "cached_token_share"
            else f"{r[c]:.0f}"
            if isinstance(r[c], (int, float))
            else "n/a"
            for c in cols
        ]
        lines.append(f"| {label(r)} | " + " | ".join(vals) + " |")
    return lines


def spread_cell(r: dict, key: str) -> str:
    spread = r.get(f"{key}_spread")
    return pct(r[key]) if spread is None or r[key] is None else f"{pct(r[key])} ({100 * spread:.1f})"


def policy_label(r: dict) -> str:
    return (
        name(r["policy"])
        if r["policy"] == "lvf" or r["transfer_mode"] == "duplex"
        else f"{name(r['policy'])} ({r['transfer_mode']})"
    )


BASELINE_NOTES = {
    "fcfs": "vLLM V1's scheduler: running requests first, then waiting ones in arrival order; a request short of "
    "blocks preempts the newest arrival and its KV is recomputed; a step that preempted admits nobody.",
    "trtllm": "TensorRT-LLM's guaranteed-no-evict: admitted in arrival order only if HBM holds prompt + max_tokens "
    "on top of every running request's same reservation (max_tokens is the client's cap, not the true length); "
    "never preempts.",
    "lightllm": "LightLLM's router: admitted in arrival order while the predicted peak KV of the running set with it "
    "fits; outputs estimated as the mean output of the requests finished so far (the cap before any), at least "
    "the tokens generated + 1; a wrong estimate runs out of blocks and recomputes the newest arrival.",
    "ltr": "learning to rank: shortest predicted output first (the true length times a log-normal error, sigma "
    "{noise:g}, drawn per request); a request paused longer than the TTFT SLO since its last token goes first; a "
    "paused request that does not fit preempts (recompute) running ones ranked after it that have sampled since "
    "they started.",
    "edf": "earliest deadline first (our extra baseline): TTFT deadline until the first token, then the next "
    "token's; running requests in deadline order, the latest preempted (recompute) when blocks run out; paused "
    "requests admitted in deadline order while they fit.",
    "sf": "swapped-first (vLLM V0's order): preempted requests swap to DRAM and come back before any waiting one.",
    "wf": "waiting-first: the same swap preemption, waiting requests admitted before swapped ones.",
    "neo": "NEO's CPU offloading on vLLM V1's scheduling (our `fcfs`), as a cost-model term: the KV-cache grows by "
    "{neo} blocks in host DRAM, as many as the Grace CPU's decode attention reads (DRAM bandwidth at the GPU's "
    "memory-bound efficiency) in the time the GPU's decode step takes with HBM full of KV; KV beyond HBM lies on the "
    "host, and its share of each step's decode attention runs on the CPU beside the GPU's work, the step taking the "
    "longer of the two (NEO's asymmetric pipeline, its overlap taken as perfect; the copy of a prompt's KV to the "
    "host is not charged).",
}


def baselines_section(res: dict, hi: float) -> list[str]:
    """The baselines as the systems behave, and LVF against each at the highest rate."""
    st, r16 = res["setting"], res["fig16"]
    noise = st.get("predictor_noise", 1.0)
    lvf = at(r16, "lvf", hi)
    neo = at(r16, "neo", hi)["neo_host_blocks"]
    L = [
        "## The baselines",
        "",
        "Each is a policy on the same scheduler core (`services/scheduler/core/baselines.py`, `fcfs.py`), so "
        "admission, preemption and the block pools are the systems' rules on our engine; they also run live "
        "(`--policy`). All but sf and wf preempt by recompute. Requests ask `max_tokens` = "
        f"{st.get('max_tokens', 0)} (a chat client's cap) and end at their true ShareGPT length with a stop token, so no "
        "policy knows an output's length in advance.",
        "",
        *[f"- **{name(p)}**{' (our `fcfs`)' if p == 'fcfs' else ''}: {BASELINE_NOTES[p].format(noise=noise, neo=neo)}" for p in BASELINES],
        "",
        f"LVF against each at {hi:g} req/s (means over {lvf.get('seeds', 1)} seeds; a difference within the larger "
        "spread of the two is a tie):",
        "",
        "| baseline | TTFT att. (spread) | TBT att. (spread) | LVF TTFT − it | LVF TBT − it | preempt. | recomp. |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in BASELINES:
        b = at(r16, p, hi)
        cells = [verdict(*compare(lvf, b, k)) for k in ("ttft_attainment", "tbt_attainment")]
        L.append(
            f"| {name(p)} | {spread_cell(b, 'ttft_attainment')} | {spread_cell(b, 'tbt_attainment')} | "
            f"{cells[0]} | {cells[1]} | {b['num_preemptions']:.0f} | {b['num_recomputes']:.0f} |"
        )
    L.append(
        f"| (LVF) | {spread_cell(lvf, 'ttft_attainment')} | {spread_cell(lvf, 'tbt_attainment')} | | | "
        f"{lvf['num_preemptions']:.0f} | {lvf['num_recomputes']:.0f} |"
    )
    return [*L, ""]


def _dram(hw: dict) -> str:
    """The DRAM given to the KV-cache: a fixed size, or a share of the host memory."""
    if hw.get("kv_dram_gb") is not None:
        return f"{hw['kv_dram_gb']:g} GB of the {hw['host_gb']:g} GB Grace DRAM"
    return f"{hw['dram_fraction']:g} × {hw['host_gb']:g} GB Grace DRAM"


def render_results(results: Path) -> str:
    """The Markdown from the rows in `results` (`reproduction.json`) and the simulator-vs-live
    runs on record there: nothing else goes into it."""
    return render(json.loads((results / ROWS_FILE).read_text()), simlive.load_runs(results))


def render(res: dict, simlive_runs: list[dict]) -> str:
    """The Markdown from the reproduction's rows (`reproduction.json`'s contents: one list of
    rows per figure, the claims, the paper-speed factor, and `setting`, what the simulator ran:
    bench/sim/reproduce.py `setting_record`)."""
    st = res["setting"]
    hw, m, w, cfg = st["hardware"], st["model"], st["workload"], st["scheduler"]
    hi = max(st["rates"])
    r16 = res["fig16"]
    slos = f"{cfg['ttft_slo']:g} s / {cfg['tbt_slo'] * 1e3:g} ms"
    L = [
        "# SuperInfer's experiments, reproduced in the simulator",
        "",
        f"Generated by `superinfer bench reproduce` in {st['seconds']:.0f} s ({st['num_runs']} simulated runs); every number below",
        "comes from that run (rows: `bench/results/reproduction.json`, one CSV per figure; plots: `bench/results/*.png`).",
        "Regenerate it rather than edit it.",
        "",
        "The simulator (`superinfer bench sim`) drives the scheduler core the live service runs — the",
        "same `SchedulerCore`, policies and block manager — on a virtual clock. Its worker is a cost model",
        "(`bench/sim/costmodel.py`): a roofline step time from the model's shape and the GPU's compute and HBM",
        "bandwidth, and copy times from the link's segment-size curve, the transfer mode and the duplex cap.",
        "",
        "## Setting",
        "",
        f"- **Model** {m['name']} ({m['params_b']:.1f} B parameters, bf16; KV block of {cfg['block_size']} tokens = {m['block_mib']:g} MiB).",
        f"- **Hardware** `{hw['name']}`: {hw['tflops']:g} TFLOP/s bf16 dense at {hw['compute_efficiency']:g} efficiency, "
        f"{hw['hbm_tbs']:g} TB/s HBM at {hw['hbm_efficiency']:g}, {hw['step_overhead_ms']:g} ms fixed per step; "
        f"{hw['hbm_gb']:g} GB HBM at {hw['mem_utilization']:g} utilization minus the weights = "
        f"**{st['num_hbm_blocks']} HBM blocks** ({st['num_hbm_blocks'] * cfg['block_size'] / 1000:.1f} k tokens); "
        f"{_dram(hw)} = {st['num_dram_blocks']} DRAM blocks. "
        f"Link: {hw['link_gbs']:g} GB/s per direction at >= 8 MB segments, {hw['link_gbs_64k']:.1f} GB/s at 64 KB, "
        f"{hw['dram_gbs']:g} GB/s DRAM both ways (x{hw['duplex_efficiency']:g} reached).",
        f"- **Workload** ShareGPT, {w['num_requests']} requests sampled as vLLM's benchmark samples them "
        f"(mean {w['mean_prompt_tokens']:.0f} prompt / {w['mean_output_tokens']:.0f} output tokens, counted with the bundled "
        "SmolLM2 tokenizer), Poisson arrivals, seeds "
        f"{', '.join(str(x) for x in st.get('seeds', [st['seed']]))} (each seed its own sample and arrivals; every number "
        "is the mean over the seeds, spreads are max − min); each request generates exactly its ShareGPT answer length. "
        + conversations_setting(st),
        f"- **Scheduler** chunked prefill {cfg['max_batched_tokens']} tokens and {cfg['max_num_seqs']} requests per step "
        "(vLLM V1's defaults on a >= 70 GiB GPU), "
        f"B_xfer {cfg['xfer_budget']}, α {cfg['alpha']:g}, β_F {cfg['beta_f']:g}, β_B {cfg['beta_b']:g}; "
        f"SLOs TTFT {cfg['ttft_slo']:g} s, TBT {cfg['tbt_slo'] * 1e3:g} ms; LVF's guards `min_residency_s` "
        f"{cfg.get('min_residency_s', 2.0):g} s, `admit_watermark` {cfg.get('admit_watermark', 0.0):g}, "
        f"`slo_chunking` {'on' if cfg.get('slo_chunking') else 'off'} (README, "
        "\"Scheduling and memory knobs\"). " + _scheduling(st),
        "- **Metrics** as `bench serve` computes them (`bench/report/metrics.py`): "
        f"TTFT attainment = requests with TTFT <= {cfg['ttft_slo']:g} s;",
        f"  TBT attainment = token gaps <= {cfg['tbt_slo'] * 1e3:g} ms over all gaps (the paper's client).",
        "",
        "## The paper's claims, checked",
        "",
        *conversation_claims(res),
        "On ShareGPT as vLLM's benchmark samples it (single first turns; no memory pressure at 144 GB, below):",
        "",
        *claims_table(res["claims"]),
        "",
        *pressure_claims(res),
        *discussion(res, hi),
        "",
        *baselines_section(res, hi),
        f"## Fig. 16 — TTFT and TBT SLO attainment vs rate ({m['name']}, {hw['name']}, ShareGPT, {slos})",
        "",
        "Cells are TTFT / TBT attainment, means over the seeds (in parentheses the spread, max − min, in points). "
        "Every policy runs on our core and our DuplexKV cost model.",
        "",
        *attainment_table(r16, policy_label),
        "",
        "![Fig. 16](results/fig16.png)",
        "",
        f"At {hi:g} req/s:",
        "",
        *detail_table([r for r in r16 if r["rate"] == hi], "policy", policy_label),
        "",
        *chunking_table(res),
        "**Baselines on vLLM's swap path** (`vllm`: its small copies, ~10 GB/s, the step waiting for them), LVF on "
        "DuplexKV:",
        "",
        *attainment_table(res["fig16_systems"], policy_label),
        "",
        f"**At the paper's measured speed**: the GPU slowed by ×{res['paper_factor']:.2f} so that LVF's mean model time per "
        f"step at {hi:g} req/s is the paper's {PAPER_STEP['model_ms']} ms (ours, as profiled: "
        f"{at(r16, 'lvf', hi)['compute_ms_mean']:.1f} ms):",
        "",
        *attainment_table(res["fig16_slow"], policy_label),
        "",
        "![Fig. 16 at paper speed](results/fig16_paper_speed.png)",
        "",
    ]
    L += render_models(res)
    L += render_pressure(res)
    L += render_fig1(res)
    L += render_rest(res, hi)
    L += simlive.markdown(simlive_runs)
    return "\n".join(L) + "\n"


def chunking_table(res: dict) -> list[str]:
    """LVF with and without its SLO chunking (rows written before the ablation have none)."""
    if "fig16_no_chunking" not in res:
        return []
    rows = [r for r in res["fig16"] if r["policy"] == "lvf"] + res["fig16_no_chunking"]
    label = lambda r: "LVF" if r.get("slo_chunking") else "LVF, no SLO chunking"  # noqa: E731
    return [
        "**LVF without its SLO chunking** (`--no-slo-chunking`: prefill chunks take the whole token budget while "
        "requests decode, as in every baseline):",
        "",
        *attainment_table(rows, label),
        "",
    ]


def claims_table(rows) -> list[str]:
    """(claim, what we measured, holds) rows as a table."""
    return [
        "| claim (Fig. 16) | ours | holds |",
        "|---|---|---|",
        *[f"| {c} | {o} | {'yes' if ok else '**no**'} |" for c, o, ok in rows],
    ]


def pressure_claims(res: dict) -> list[str]:
    """The same claims with the KV cache cut to its smallest share (rows written before they
    were checked there have none)."""
    if "claims_pressure" not in res:
        return []
    blocks = min(r["num_hbm_blocks"] for r in res["fig16_pressure"])
    return [
        f"The same claims with the KV cache cut to {blocks} HBM blocks (section \"Fig. 16 under more memory "
        "pressure\"), where it fills before the GPU's compute does:",
        "",
        *claims_table(res["claims_pressure"]),
        "",
    ]


def conversations_setting(st: dict) -> str:
    """The conversations workload, as the setting paragraph tells it."""
    c = st["conversations"]
    return (
        f"**ShareGPT conversations** (where the KV-cache fills; claims first below): {c['num_conversations']} "
        f"conversations per seed ({c['num_turns']} turns) replayed turn by turn at their real lengths (up to a 32k "
        f"context), each turn's prompt the whole history (mean {c['mean_prompt_tokens']:.0f} prompt / "
        f"{c['mean_output_tokens']:.0f} output tokens a turn; a conversation ends at {c['mean_context_tokens']:.0f} "
        f"tokens of context on average, {c['max_context_tokens']} at most), the next turn sent {c['think_s']:g} s after "
        "the previous one ends; conversations arrive by Poisson at "
        f"{', '.join(f'{r:g}' for r in c['rates'])} per second; prefix caching on for every policy (vLLM V1's default)."
    )


def conversation_claims(res: dict) -> list[str]:
    """The claims on the ShareGPT conversations, with their Fig. 16."""
    rows = res["fig16_conv"]
    hi = max(r["rate"] for r in rows)
    return [
        "On ShareGPT conversations, where memory pressure arises across the swept rates as in the paper "
        f"({rows[0]['num_hbm_blocks']} HBM blocks, the paper's 144 GB; rates in conversations/s, each ~"
        f"{rows[0]['completed'] / max(res['setting']['conversations']['num_conversations'], 1):.1f} requests):",
        "",
        *claims_table(res["claims_conv"]),
        "",
        "Fig. 16 on the conversations (TTFT / TBT attainment, spread in parentheses; `(vllm)`: on vLLM's swap path):",
        "",
        *attainment_table(rows, policy_label, "conversations/s"),
        "",
        f"At {hi:g} conversations/s (`cached`: prompt tokens found in the prefix cache):",
        "",
        *detail_table([r for r in rows if r["rate"] == hi], "policy", policy_label, cached=True),
        "",
    ]


def render_models(res: dict) -> list[str]:
    """Fig. 16 on Llama-3-8B and Mixtral-8x7B (rows written before they were added have none)."""
    rows = res.get("fig16_models", [])
    L = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        r0 = mine[0]
        L += [
            f"## Fig. 16 on {model} ({r0['hardware']}, {r0['num_hbm_blocks']} HBM blocks)",
            "",
            *attainment_table(mine, policy_label),
            "",
            f"LVF's TTFT lead over the best baseline: {lead_cell(mine, BASELINES)}; over vllm-v1: "
            f"{lead_cell(mine, ('fcfs',))}. Preemptions at {max(r['rate'] for r in mine):g} req/s: "
            + ", ".join(f"{policy_label(r)} {r['num_preemptions']:.0f}" for r in mine if r["rate"] == max(x["rate"] for x in mine))
            + ".",
            "",
        ]
    return L


def render_pressure(res: dict) -> list[str]:
    """Fig. 16 with less HBM, and LVF's leads at every operating point."""
    points = operating_points(res)
    full = next(iter(points))
    L = [
        "## Fig. 16 under more memory pressure",
        "",
        "The same requests and rates with the KV cache cut to "
        + " and ".join(f"{round(100 * b / full)}%" for b in list(points)[1:])
        + " of the HBM blocks (as if the model or the context were larger).",
        "",
    ]
    for blocks, rows in list(points.items())[1:]:
        L += [f"**{blocks} HBM blocks**", "", *attainment_table(rows, policy_label), ""]
    L += [
        "LVF's TTFT attainment minus the best of the named baselines', in points: its largest lead at any rate "
        "(with LVF's TBT attainment there, in points below the best policy's) and its largest deficit.",
        "",
        "| HBM blocks | vs the best baseline | " + " | ".join(f"vs {name(p)}" for p in BASELINES) + " |",
        "|---:|---|" + "---|" * len(BASELINES),
    ]
    for blocks, rows in points.items():
        cells = [lead_cell(rows, bases) for bases in (BASELINES, *((p,) for p in BASELINES))]
        L.append(f"| {blocks} | " + " | ".join(cells) + " |")
    return [*L, ""]


def lead_cell(rows: list[dict], baselines) -> str:
    ls = leads(rows, baselines)
    lead, rate, _ = max(ls)
    worst, wrate, _ = min(ls)
    if lead < 0.05:
        return f"never ahead; {worst:+.1f} at {wrate:g} req/s"
    tbt_gap = tbt_behind(rows, rate)
    deficit = f"; {worst:+.1f} at {wrate:g} req/s" if worst < -0.05 else ""
    return f"**{lead:+.1f}** at {rate:g} req/s (TBT {tbt_gap:.1f} below){deficit}"


def render_fig1(res: dict) -> list[str]:
    rows = fig1_rows(res)
    wf, sf, fcfs = rows
    return [
        f"## Fig. 1 — WF vs SF under memory pressure ({fcfs['rate']:g} conversations/s, vLLM's swap path)",
        "",
        "Paper: waiting-first gets better TTFT but worse TBT; swapped-first keeps TBT steady with TTFT close to FCFS.",
        "",
        *detail_table(rows, "policy", policy_label),
        "",
        f"Ours: WF's TTFT attainment is {100 * (wf['ttft_attainment'] - sf['ttft_attainment']):+.1f} points vs SF "
        f"(SF vs FCFS: {100 * (sf['ttft_attainment'] - fcfs['ttft_attainment']):+.1f}); WF's TBT attainment "
        f"{100 * (wf['tbt_attainment'] - sf['tbt_attainment']):+.1f} points vs SF, TBT p99 {wf['tbt_p99_ms']:.0f} vs "
        f"{sf['tbt_p99_ms']:.0f} ms, requests meeting TBT on every gap {pct(wf['tbt_request_attainment'])} vs "
        f"{pct(sf['tbt_request_attainment'])}.",
        "",
        "![Fig. 1](results/fig1_wf_vs_sf_cdf.png)",
        "",
    ]


def render_rest(res: dict, hi: float) -> list[str]:
    st = res["setting"]
    d = st["scheduler"]["xfer_budget"]
    abl = lambda r: f"LVF {r['transfer_mode']} B_xfer={r['xfer_budget']}"  # noqa: E731
    knob = lambda k: lambda r: f"{k}={r[k]:g}"  # noqa: E731
    top = max(r["rate"] for r in res["fig17"])
    lvf = at(res["fig17"], "lvf", top, transfer_mode="duplex")
    t1 = res["table1"]
    L = [
        "## Fig. 17 — ablation: LVF on vLLM's swap path (the paper's and a large B_xfer) vs LVF with DuplexKV",
        "",
        f"On the ShareGPT conversations (rates in conversations/s). B_xfer {min(r['xfer_budget'] for r in res['fig17'])} "
        f"blocks (the paper's) and {d} on vLLM's swap path (`vllm`: small copies, the step waits for them, no eager "
        "rotation), then DuplexKV. Copies per step: mean ms of link time.",
        "",
        *attainment_table(res["fig17"], abl, "conversations/s"),
        "",
        *detail_table([r for r in res["fig17"] if r["rate"] == top], "variant", abl),
        "",
        "![Fig. 17](results/fig17.png)",
        "",
        f"## Fig. 21 — B_xfer sweep (LVF, {hi:g} req/s)",
        "",
        *detail_table(res["fig21"], "B_xfer", lambda r: f"{r['transfer_mode']} {r['xfer_budget']}"),
        "",
        "![Fig. 21](results/fig21.png)",
        "",
        f"## Figs. 18–20 — α, β_F, β_B (LVF, {hi:g} req/s)",
        "",
        "Paper: raising β_F delays waiting requests (TTFT falls); raising β_B delays paused ones (TBT falls);",
        "α weighs paused requests that have emitted tokens against waiting ones.",
        "",
    ]
    for k, rows in knob_rows(res).items():
        L += [f"**{k}**", "", *detail_table(rows, k, knob(k)), "", f"![{k}](results/fig_{k}.png)", ""]
    L += [
        "## Table 1 — moving 16 GB on gh200 (8 GB each way, Qwen2.5-32B blocks)",
        "",
        "| mode | ours ms | ours GB/s (both ways) | paper |",
        "|---|---:|---:|---|",
        *[f"| {r['mode']} | {r['ms']:.1f} | {r['gbs_total']:.1f} | {PAPER_TABLE1.get(r['mode'], '')} |" for r in t1],
        "",
        f"## Per-step costs (LVF on DuplexKV, conversations at {top:g}/s)",
        "",
        "| | paper (GH200) | ours (simulated gh200) |",
        "|---|---:|---:|",
        f"| scheduling ms | {PAPER_STEP['schedule_ms']} | our core's `schedule()` on this CPU: "
        f"{lvf['sched_wall_ms_p50']:.2f} p50 / {lvf['sched_wall_ms_p99']:.2f} p99"
        + (" (what each step takes) |" if st.get("sched_time") == "measured" else f"; {st['hardware']['sched_ms']:g} modelled |"),
        f"| copies ms | {PAPER_STEP['transfer_ms']} | {lvf['xfer_ms_mean']:.1f} |",
        f"| model ms | {PAPER_STEP['model_ms']} | {lvf['compute_ms_mean']:.1f} |",
        f"| steps that stall | {PAPER_STEP['stall_pct']}% | {100 * lvf['stall_share']:.3f}% of GPU time |",
        "",
    ]
    return L
