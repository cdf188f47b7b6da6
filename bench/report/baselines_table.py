"""The baselines as they really run, beside how we model them: the table REPRODUCTION.md
renders (`markdown()`), one row per policy. Each rule was read from the real project's code
at the commit named; what we model is in services/scheduler/core/baselines.py and ltr.py
(scheduling) and bench/sim/costmodel.py (NEO's host attention and copies).

Plain data: a reader may check any row against the file it names."""

from __future__ import annotations

from dataclasses import dataclass



@dataclass(frozen=True)
class Source:
    repo: str  # owner/name on GitHub
    commit: str  # the commit read
    paths: tuple[str, ...]  # the files the rule is in ("path@commit" where read at another commit)

    def cite(self) -> str:
        files = ", ".join(f"`{p.split('@')[0]}`" + (f" @ `{p.split('@')[1][:12]}`" if "@" in p else "") for p in self.paths)
        return f"{self.repo} @ `{self.commit[:12]}`: {files}"


@dataclass(frozen=True)
class Baseline:
    policy: str  # our policy name (`--policy`, or `neo` in the simulator)
    system: str
    real: str  # what the real system does
    source: Source | None  # None: a policy of ours, no real project
    modeled: str  # how our core (and cost model) runs it
    left_out: str  # what we do not model


LIGHTLLM = Source(
    "ModelTC/lightllm",
    "fc72ffab9a3455cfb571f22d45ab777cc29de0de",
    (
        "lightllm/server/core/objs/req.py",
        "lightllm/server/router/req_queue/chunked_prefill/impl.py",
        "lightllm/server/router/req_queue/base_queue.py",
        "lightllm/server/router/manager.py",
        "lightllm/server/router/pause_strategy.py",
        "lightllm/server/api_cli.py",
    ),
)
TRTLLM = Source(
    "NVIDIA/TensorRT-LLM",
    "cf6abc45df6e3470d8c378366896882e1f43e60c",
    (
        "cpp/tensorrt_llm/batch_manager/capacityScheduler.cpp",
        "cpp/tensorrt_llm/batch_manager/scheduledBlocksManager.h@1ce9149bf3c290610ec8091806d68f6226ce3328",
        "cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp@b35ac1b64368513d215c57d2ed01d62d910df8da",
    ),
)
LTR = Source(
    "hao-ai-lab/vllm-ltr",
    "13bbf6ff3dab661791d41362551b089e5f77c91c",
    ("vllm/core/scheduler.py", "benchmarks/fair-sharegpt-70B.sh"),
)
NEO = Source(
    "shaochangliu/25MLSYS-NEO",  # a copy of NEO's MLSys'25 artifact (swiftLLM-based)
    "621dcb28c7ce81d532eb54807dc8bc32701f1a4e",
    ("swiftllm/server/scheduler.py",),
)

BASELINES: tuple[Baseline, ...] = (
    Baseline(
        "trtllm",
        "TensorRT-LLM (GUARANTEED_NO_EVICT, its default)",
        "Running requests first, each keeping the blocks it needs to complete "
        "(`getRemainingBlocksToCompletion`: prompt + max_new_tokens, less what it holds); then pending "
        "requests in arrival order while the free blocks, less every admitted request's remainder, hold "
        "theirs; the first that does not fit ends admission. Never evicts.",
        TRTLLM,
        "The same reservation in our blocks, prefix-cache hits subtracted (a hit on a cached, "
        "unreferenced block still takes a free one); head-of-line admission; no preemption. Clients send "
        "each request's own output length as max_tokens (`vllm bench serve`), and a request ends there.",
        "Its check at admission counts a new request's whole reservation (nothing is allocated yet) and "
        "subtracts shared blocks only once admitted: ours is up to the shared blocks more permissive. "
        "`beneficialToSkip` (deferring a prompt whose prefix another request is computing this step), "
        "LoRA/PEFT pages, beam search, variable attention windows.",
    ),
    Baseline(
        "trtllm-maxutil",
        "TensorRT-LLM (MAX_UTILIZATION)",
        "All active requests in arrival order, each asking only for its next step's blocks "
        "(`getNeededBlocksOneStep`); one that does not fit pauses the last started request behind it "
        "(its KV freed, recomputed later) and the list ends there; with none behind it, scheduling stops.",
        TRTLLM,
        "The same walk in arrival order over running and paused requests; a paused request asks for its "
        "whole prompt's blocks (`reserve_full_prompt`); victims are preempted by recompute; decodes then "
        "take the step's token budget before prefill chunks, as its micro-batch scheduler does.",
        "Two-steps look-ahead, `beneficialToSkip`, LoRA/PEFT pages, beam search.",
    ),
    Baseline(
        "lightllm",
        "LightLLM (router, chunked prefill)",
        "Waiting requests in arrival order while the predicted peak of the batch stays under the token "
        "pool: each request counts (held + 1, still to come), still to come = max_new_tokens left while "
        "the router is busy (always at the default `router_token_ratio` 0.0), else max(1.1 x output so "
        "far, `router_max_new_token_len` 1024) left, + 6, + 7 per prefill chunk still to run; peak = max "
        "over i, longest to go first, of held summed + i x the i-th's still to come. At ratio 0.0 it never "
        "pauses; above, the newest request is paused (recomputed) when decode runs out of tokens.",
        LIGHTLLM,
        "The same tuple and peak (`lightllm_tokens`, `peak_tokens`) at the default ratio 0.0, on our "
        "blocks; clients send each request's own output length as max_tokens, as for TensorRT-LLM.",
        "Its token-granular pool (ours is in blocks: a block of slack per request), frozen tokens of "
        "disaggregated modes, the `batch_max_tokens` prefill cap (our step budget plays that role), "
        "data parallelism, the separate decode-step pacing (`router_max_wait_tokens`). A request whose "
        "estimate alone passes the pool is admitted when nothing runs (LightLLM would never admit it).",
    ),
    Baseline(
        "ltr",
        "LTR (vllm-ltr, learning to rank)",
        "All requests (waiting, running, swapped) ranked by an OPT ranking model's score of the prompt, "
        "computed once at arrival; walked in rank order, each takes its tokens from the step's budget "
        "until it breaks (lower-ranked running requests wait a step); blocks are then made by swapping "
        "out the lowest-ranked running requests. Starvation guard (`starv200-period10`): a request not "
        "scheduled for 200 steps is promoted for its next 10 scheduled steps.",
        LTR,
        "The same walk (ltr.py), swap preemption on our copy engine (recompute when DRAM or B_xfer has "
        "no room), the same step-counted guard. The predictor is the true output length times a "
        "log-normal error (sigma 1, Kendall's tau about 0.55 on ShareGPT, as the LTR paper reports).",
        "The ranking model itself; vLLM V0's blocking swap path unless the run gives ltr `vllm` copies; "
        "its other schedule types (srtf, mlfq, tpt); its sequence budget counts scheduled requests, ours "
        "running ones (with max_num_seqs running, a paused request waits). An earlier version of ours "
        "preempted by recompute "
        "and promoted after the TTFT SLO: each displaced request recomputed its whole history to emit "
        "one token (15,051 recomputes, 360 tok/s at 10 conversations/s).",
    ),
    Baseline(
        "neo",
        "NEO (CPU attention offload, on swiftLLM)",
        "Requests decode on the GPU or on the CPU: prompts are prefilled on the GPU and, once GPU blocks "
        "run out, new ones go to the CPU, their prompt KV copied to host memory; decode attention of CPU "
        "requests runs on the CPU, pipelined with the GPU's work (asymmetric pipelining, load-aware "
        "batch choice); GPU requests are swapped out/in whole at thresholds. Dense Llama models only.",
        NEO,
        "vLLM V1's scheduling on a KV pool grown by the host blocks the CPU's attention can serve in a "
        "GPU decode step; a step takes the longer of the GPU's work and the CPU's attention over the "
        "host share; the host share of each step's prefilled prompt KV is copied device -> host on the "
        "link. No NEO row for MoE models (`neo_applicable`).",
        "Its per-step choice between sequential and pipelined mode, swapping whole requests between "
        "GPU and CPU, the intermediate GPU buffer for CPU-bound prefills; the overlap is taken as perfect.",
    ),
    Baseline(
        "edf",
        "EDF (ours)",
        "Not a published system: earliest deadline first, our extra baseline.",
        None,
        "TTFT deadline until the first token, then the next token's; running requests in deadline "
        "order, the latest preempted (recompute) when blocks run out; paused ones admitted in order.",
        "-",
    ),
)


def by_policy() -> dict[str, Baseline]:
    return {b.policy: b for b in BASELINES}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(policies: tuple[str, ...] | None = None) -> str:
    """The table: policy, what the real system does, file in the real project, how we model
    it, what we leave out (rows for `policies`, in their order, or all)."""
    rows = BASELINES if policies is None else tuple(by_policy()[p] for p in policies if p in by_policy())
    lines = [
        "| policy | what the real system does | file in the real project | how we model it | what we leave out |",
        "|---|---|---|---|---|",
    ]
    for b in rows:
        src = b.source.cite() if b.source else "none (ours)"
        lines.append(
            f"| **{b.policy}** ({_cell(b.system)}) | {_cell(b.real)} | {_cell(src)} | {_cell(b.modeled)} "
            f"| {_cell(b.left_out)} |"
        )
    return "\n".join(lines) + "\n"
