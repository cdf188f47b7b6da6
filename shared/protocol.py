"""Every message that crosses a socket, in one place.

Each socket carries one tagged union, encoded as msgpack (array-like structs, no pickle):

    gateway  -> scheduler : GatewayMsg    = GatewayHello | AddRequest | AbortRequest
    scheduler -> gateway  : GatewayReply  = StepOutputs | RequestError | SchedulerStats
    scheduler -> worker   : WorkerMsg     = Plan | ResetWorker
    worker   -> scheduler : WorkerReply   = WorkerReady | StepResult | WorkerError | WorkerBusy
    operator -> scheduler : AdminRequest  = QueuesQuery | StatsQuery | AbortCommand | DrainCommand
    scheduler -> operator : AdminReply    = QueuesReply | StatsReply | AdminAck | AdminError

No tensors cross a socket: only token ids and block ids. A new request's prompt is
sent to the worker once (in `Plan.new_requests`); later plans carry only how many
tokens to compute and which blocks changed.
"""

from __future__ import annotations

import msgspec
from msgspec import Struct


class _Msg(Struct, array_like=True, omit_defaults=True, gc=False, tag_field="t"):
    """Base for tagged messages (the tag is the first array element)."""


class _Data(Struct, array_like=True, omit_defaults=True, gc=False):
    """Base for untagged payload structs nested inside messages."""


# ---------------------------------------------------------------- shared pieces


class SamplingParams(_Data):
    max_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (0 = off)
    seed: int | None = None
    # Generation stops when one of these is sampled (EOS and the model's end-of-turn ids).
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # Log probabilities, of the model's own distribution (vLLM's default, "raw"): before
    # penalties, bias, temperature and top-k/top-p. None: not asked; k >= 0: the token's own
    # and the k most likely. `prompt_logprobs` scores every prompt token after the first.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Logit processors, in vLLM's order and semantics: until `min_tokens` are out the stop
    # tokens are masked; `logit_bias` is added; `repetition_penalty` divides positive logits
    # (multiplies negative ones) of tokens seen in the prompt or the output; `frequency_penalty`
    # (per occurrence) and `presence_penalty` (once) are subtracted for tokens of the output.
    min_tokens: int = 0
    logit_bias: dict[int, float] = {}
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # Structured output: an llguidance grammar (its JSON text, from `response_format`). The
    # worker masks every token the grammar does not allow and, once the grammar is complete,
    # allows only the stop tokens. A worker that gets the request with outputs already
    # generated (a failover) replays them through the grammar first.
    grammar: str | None = None


class TokenLogprobs(_Data):
    """One position: the log probability of its token and those of the k most likely tokens
    (most likely first)."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class SLO(_Data):
    """Per-request SLO overrides in seconds; None falls back to the scheduler's defaults."""

    ttft_s: float | None = None
    tbt_s: float | None = None


# ---------------------------------------------------------------- gateway <-> scheduler


class GatewayHello(_Msg, tag="hello"):
    """First message of a gateway on connect (and its heartbeat): the scheduler learns the
    gateway's identity and starts sending it `SchedulerStats`. `want_cache`: the gateway has no
    (trusted) copy of this scheduler's cached blocks; the answer carries them all
    (`CacheEvents.snapshot`)."""

    gateway_id: str
    want_cache: bool = False


class AddRequest(_Msg, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    slo: SLO | None = None
    # Tokens already generated for this request (a resubmission after a failover).
    output_token_ids: list[int] = []
    # A resubmission of a request some scheduler admitted before (a failover): the waiting-
    # queue bounds, which keep new load out, do not refuse it.
    resumed: bool = False


class AbortRequest(_Msg, tag="abort"):
    request_id: str


GatewayMsg = GatewayHello | AddRequest | AbortRequest


class Attribution(_Data):
    """Where one request's time went at the scheduler, in seconds: the answer to "why did it
    miss its SLO". `transfer_wait_s` is the part of `running_s` its steps spent waiting for
    swap-ins to land."""

    waiting_s: float = 0.0
    rotary_s: float = 0.0
    running_s: float = 0.0
    transfer_wait_s: float = 0.0
    num_preemptions: int = 0


class TokenOutput(_Data):
    request_id: str
    token_ids: list[int]
    # "stop" (stop token), "length" (max_tokens or context window), "abort"; None while running.
    finish_reason: str | None = None
    # On the final output only: where the request's time went at the scheduler.
    attribution: Attribution | None = None
    # One per token of `token_ids` when the request asked for logprobs.
    logprobs: list[TokenLogprobs] = []
    # With the first token, when asked: prompt tokens 1.. (the first has no logprob).
    prompt_logprobs: list[TokenLogprobs] = []
    # With the first token: prompt tokens whose KV came from the prefix cache, and of those
    # the ones loaded from its DRAM tier.
    num_cached_tokens: int = 0
    num_dram_cached_tokens: int = 0


class StepOutputs(_Msg, tag="out"):
    outputs: list[TokenOutput]


class RequestError(_Msg, tag="error"):
    request_id: str
    message: str
    # OpenAI-style error type: "invalid_request_error", "overloaded", "internal_error"; or
    # GATEWAY_SILENT, which a gateway answers by resubmitting, never showing it to a client.
    type: str = "internal_error"


# A scheduler aborted the request because its gateway had gone silent (frozen, cut off).
GATEWAY_SILENT = "gateway_silent"


def block_key(h: bytes) -> int:
    """A prefix-cache block's name on the wire: the first 8 bytes of its chain hash
    (services/scheduler/core/prefix.py) as a signed 64-bit int. Routing only (a collision
    costs a misrouted request, never wrong KV): 9 bytes in msgpack instead of 18."""
    return int.from_bytes(h[:8], "little", signed=True)


class CacheEvents(_Data):
    """Prefix-cache blocks (`block_key`s) a scheduler gained and dropped since its previous
    report, in HBM and in DRAM (its host tier and rotated requests' copies), at most
    `MAX_CACHE_EVENTS` in all per report (the rest follow in the next). `snapshot`: instead,
    every block it holds (`*_added` only), the answer to `GatewayHello.want_cache`."""

    hbm_added: list[int] = []
    hbm_removed: list[int] = []
    dram_added: list[int] = []
    dram_removed: list[int] = []
    snapshot: bool = False


MAX_CACHE_EVENTS = 2048


class SchedulerStats(_Msg, tag="stats"):
    """Load report, sent to every known gateway after each step and at least once a second
    when idle (it doubles as the scheduler's heartbeat)."""

    scheduler_id: str
    model_name: str
    max_model_len: int
    num_waiting: int
    num_running: int
    num_rotary: int
    num_hbm_blocks: int
    num_free_hbm_blocks: int
    num_dram_blocks: int
    num_free_dram_blocks: int
    num_preemptions: int = 0
    num_recomputes: int = 0
    num_rotations_out: int = 0
    num_rotations_in: int = 0
    num_blocks_swapped_in: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_mirrored: int = 0
    worker_ready: bool = True
    draining: bool = False  # admits no new requests
    worker_id: str = ""  # the ready worker's `WorkerReady.worker_id`
    # Waiting or rotary requests the last step could have run and left out (requests that
    # arrived since are not counted: they have not had their chance yet).
    num_queued: int = 0
    # What the gateway's routing score needs of the scheduler's setup: requests per step at
    # most (its --max-num-seqs) and tokens per KV block (its worker's; 0 until one is ready).
    max_num_seqs: int = 0
    block_size: int = 0
    # The DRAM prefix-cache tier: its size and cached blocks, prompt tokens looked up there
    # (past the HBM hits) and found and loaded.
    num_tier_blocks: int = 0
    num_cached_dram_blocks: int = 0
    num_tier_queries: int = 0
    num_tier_hits: int = 0
    # Prompt tokens looked up in the (HBM) prefix cache at admission, and found there.
    num_prefix_queries: int = 0
    num_prefix_hits: int = 0
    # What the gateway's cache-aware routing predicts a TTFT from (services/gateway/routing.py):
    # prompt tokens that waiting requests have yet to compute, the step-time model's fit
    # (seconds per step, seconds per token; 0 until it has one), the step's token budget, and the
    # seconds one block takes to copy from DRAM (0: unknown).
    num_queued_tokens: int = 0
    step_s: float = 0.0
    prefill_s_per_token: float = 0.0
    max_batched_tokens: int = 0
    block_copy_s: float = 0.0
    # Cached blocks: `cache_seq` numbers the reports that carried `cache` events (0: none yet);
    # a gateway that sees a gap asks for a snapshot (`GatewayHello.want_cache`).
    cache_seq: int = 0
    cache: CacheEvents | None = None
    # The ready worker's `WorkerReady.native_missing`: why it runs without its native kernels.
    native_missing: str = ""


GatewayReply = StepOutputs | RequestError | SchedulerStats


# ---------------------------------------------------------------- scheduler <-> worker


class NewRequestData(_Data):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = []


class ScheduledRequest(_Data):
    """One request's share of a step: compute `num_new_tokens` tokens from position
    `num_computed_tokens` of its token sequence (prompt + outputs)."""

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    # Blocks appended to the request's HBM block table this step.
    new_block_ids: list[int] = []
    # When set, replaces the whole HBM block table (after a swap-in or a recompute restart).
    block_table: list[int] | None = None


class Plan(_Msg, tag="plan"):
    step_id: int
    new_requests: list[NewRequestData] = []
    scheduled: list[ScheduledRequest] = []
    # Block copies, as (src, dst) pairs: DRAM->HBM, HBM->DRAM (preemption) and
    # HBM->DRAM eager mirrors of synced blocks.
    swap_in: list[tuple[int, int]] = []
    swap_out: list[tuple[int, int]] = []
    eager: list[tuple[int, int]] = []
    # Requests whose state the worker drops (finished or aborted). A request preempted for
    # recompute is not dropped: it is scheduled again from num_computed_tokens=0.
    drop: list[str] = []


class ResetWorker(_Msg, tag="reset"):
    """After the plans already sent: drop every request and announce again (`WorkerReady`).
    Sent when the scheduler gave up on the worker's state (a step overdue or failed) and the
    worker may still be there (frozen, slow): it comes back with empty pools, no restart."""

    reason: str = ""


WorkerMsg = Plan | ResetWorker


class WorkerReady(_Msg, tag="ready"):
    model_name: str
    num_hbm_blocks: int
    num_dram_blocks: int
    block_size: int
    max_model_len: int
    device: str
    block_bytes: int = 0  # bytes of one KV block (all layers, K and V)
    vocab_size: int = 0  # 0: not reported (prompt ids are then not checked)
    worker_id: str = ""  # this worker process (new with every start)
    copy_gbps: float = 0.0  # DRAM->HBM copy bandwidth measured at start (0: not measured)
    # Why this CPU worker runs its steps on the torch path, 5-10x slower than its native kernels
    # (no C compiler, a failed build, no AVX-512, turned off); "" where they run, or on a GPU.
    native_missing: str = ""


class StepTimings(_Data):
    """Where a step's wall time went on the worker (seconds)."""

    # Copies of this step: swap-ins, swap-outs and eager mirrors, both directions.
    transfer_s: float = 0.0
    compute_s: float = 0.0
    # Compute waited this long for the swap-ins it reads (a transfer stall).
    transfer_wait_s: float = 0.0
    # The worker sat idle this long between its previous step and this plan (a plan stall
    # when the scheduler had work).
    plan_wait_s: float = 0.0


class StepResult(_Msg, tag="result"):
    step_id: int
    # Sampled token per request that reached the end of its known tokens this step.
    request_ids: list[str] = []
    token_ids: list[int] = []
    timings: StepTimings = msgspec.field(default_factory=StepTimings)
    # Only for the requests that asked: the sampled token's logprobs, and the prompt's
    # (once, in the step that samples the first token).
    logprobs: dict[str, TokenLogprobs] = {}
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
    # Requests this step failed on its own (the step raised with them, twice, and ran without
    # them): request id -> what was raised. The worker has dropped them.
    failed: dict[str, str] = {}


class WorkerError(_Msg, tag="worker_error"):
    step_id: int
    message: str


class WorkerBusy(_Msg, tag="busy"):
    """Said every second by a worker still computing `step_id` (its socket thread says it): a
    slow step on a saturated host is not a lost worker. A frozen process says nothing."""

    step_id: int


WorkerReply = WorkerReady | StepResult | WorkerError | WorkerBusy


# ---------------------------------------------------------------- codecs

_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode

gateway_msg_decoder = msgspec.msgpack.Decoder(GatewayMsg)
gateway_reply_decoder = msgspec.msgpack.Decoder(GatewayReply)
worker_msg_decoder = msgspec.msgpack.Decoder(WorkerMsg)
worker_reply_decoder = msgspec.msgpack.Decoder(WorkerReply)


# ---------------------------------------------------------------- operator <-> scheduler (admin)
# The scheduler's admin socket (ROUTER) answers the operator CLI. Queries are open; commands
# that change what the scheduler does carry the admin token.


class QueuesQuery(_Msg, tag="admin_queues"):
    """Every live request, one row each."""


class StatsQuery(_Msg, tag="admin_stats"):
    """Load, pools and counters, plus the last minute's step times, transfers and SLO attainment."""


class AbortCommand(_Msg, tag="admin_abort"):
    request_id: str
    token: str = ""


class DrainCommand(_Msg, tag="admin_drain"):
    """Stop admitting new requests (they are refused as unavailable) and finish what runs;
    `undo` admits again."""

    token: str = ""
    undo: bool = False


AdminRequest = QueuesQuery | StatsQuery | AbortCommand | DrainCommand


class RequestRow(_Data):
    request_id: str
    state: str  # waiting | running | rotary
    vlt: float  # Virtual Lag Time now: <= 0 running, >= 0 paused
    age_s: float
    since_last_token_s: float | None  # None before its first token
    # S_F minus its TTFT (minus its age before the first token); negative: missed.
    ttft_slack_s: float | None
    # S_B minus the time since its last token; None before the first token.
    tbt_slack_s: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_hbm_blocks: int
    num_dram_blocks: int
    times: Attribution  # so far
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held when it was first admitted
    num_dram_cached_tokens: int = 0  # of those, loaded from its DRAM tier


class QueuesReply(_Msg, tag="admin_queues_reply"):
    rows: list[RequestRow]
    draining: bool = False


class WindowStats(_Data):
    """The last minute (or less, since start): means per step and rates per second."""

    span_s: float
    num_steps: int = 0
    schedule_s: float = 0.0
    transfer_s: float = 0.0
    compute_s: float = 0.0
    stall_ratio: float | None = None
    rotations_per_s: float = 0.0
    blocks_moved_per_s: float = 0.0
    transfer_bytes_per_s: float | None = None  # None while the block size in bytes is unknown
    num_finished: int = 0
    ttft_attainment: float | None = None  # requests with TTFT <= S_F
    tbt_attainment: float | None = None  # token gaps <= S_B
    slo_attainment: float | None = None  # requests meeting both


class StatsReply(_Msg, tag="admin_stats_reply"):
    stats: SchedulerStats
    window: WindowStats
    policy: str
    ttft_slo_s: float
    tbt_slo_s: float
    uptime_s: float
    draining: bool = False
    num_steps: int = 0
    num_finished: int = 0
    num_aborted: int = 0


class AdminAck(_Msg, tag="admin_ack"):
    message: str


class AdminError(_Msg, tag="admin_error"):
    message: str
    # "invalid_request_error" (malformed), "permission_denied" (token), "not_found", "internal_error".
    type: str = "invalid_request_error"


AdminReply = QueuesReply | StatsReply | AdminAck | AdminError

admin_request_decoder = msgspec.msgpack.Decoder(AdminRequest)
admin_reply_decoder = msgspec.msgpack.Decoder(AdminReply)
