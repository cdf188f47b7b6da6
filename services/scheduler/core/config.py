"""Scheduler configuration: policy, budgets and the VLT constants."""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields, replace

from shared.config import DEFAULT_BLOCK_SIZE, default_mirror_watermark, default_slo_chunking

DEFAULT_XFER_BUDGET = 2400  # blocks: the paper's B_xfer on GH200
XFER_SHARE = 0.5  # of the TBT SLO a step's copies may take, where B_xfer comes from the measured bandwidth
POLICIES = (
    "lvf", "lvf-paper", "superinfer-artifact", "fcfs", "sf", "wf", "trtllm", "trtllm-maxutil", "lightllm", "ltr", "edf",
)
LVF_POLICIES = ("lvf", "lvf-paper")  # lvf-paper: LVF as the paper defines it, our guards off
# The others preempt by recompute (trtllm never preempts).
SWAPPING = ("lvf", "lvf-paper", "superinfer-artifact", "sf", "wf", "ltr")
LVF_WATERMARK = 0.25  # lvf's admit_watermark (lvf.py); the other policies' is 0


def _flag(default, help: str, **argparse_kw):
    """A knob that is also a command-line flag, `--field-name` (`--field-name/--no-field-name`
    for a bool): its help (`%(default)s` shows this default) and any other argparse keyword
    (`choices`). The CLI generates the flags from these fields (services/flags.py), so a
    default is written here and nowhere else."""
    return field(default=default, metadata={"help": help, **argparse_kw})


@dataclass
class SchedulerConfig:
    """Knobs of the scheduler core. Times are seconds, sizes are tokens or blocks.

    `xfer_budget` (B_xfer) caps the KV blocks copied in one step, swap-ins, swap-outs and
    eager mirrors together: it ties the policy to the link bandwidth.

    `reserve_full_prompt`: a paused request is admitted only if HBM has room for all its
    known tokens (prompt + generated so far), not just for the first chunk this step
    computes (vLLM V1's `scheduler_reserve_full_isl`, on by default there). Without it a
    long prompt admitted for one chunk cannot grow into its next chunk and is preempted
    at once, again and again (docs/design.md, "Scheduling and memory knobs": fcfs preempted 275 times instead of 18
    for 60 ShareGPT requests at 1 req/s on 65 blocks of 32 tokens).
    """

    policy: str = _flag(
        "lvf",
        "lvf: Largest-VLT-First rotation (SuperInfer) with our guards; lvf-paper: LVF exactly as the paper "
        "defines it (min_residency_s 0, admit_watermark 0, rotary_yields and slo_chunking off, whatever "
        "their flags say); superinfer-artifact: the scheduler the paper's authors released, as its code runs "
        "(artifact.py: keeps B_xfer blocks free by swapping out the longest-running decodes, admits the "
        "longest-waiting first; reserve_full_prompt off); fcfs: FCFS with recompute preemption; "
        "sf: swapped-first with swap preemption; wf: waiting-first with swap preemption; baselines "
        "(baselines.py): trtllm: TensorRT-LLM's GUARANTEED_NO_EVICT, admit only with room for prompt + "
        "max_tokens, never preempt; trtllm-maxutil: its MAX_UTILIZATION, an older request pauses newer "
        "ones (recompute); lightllm: admit while the predicted peak KV fits; ltr: shortest predicted "
        "output first (ltr.py, swap preemption); edf: earliest deadline first",
        choices=POLICIES,
    )
    ttft_slo: float = _flag(5.0, "TTFT SLO S_F in seconds (default %(default)s)")
    tbt_slo: float = _flag(0.1, "TBT SLO S_B in seconds (default %(default)s)")
    alpha: float = _flag(3.0, "VLT weight of rotary requests (default %(default)s)")
    beta_f: float = _flag(0.5, "TTFT slack share before VLT grows (default %(default)s)")
    beta_b: float = _flag(0.0, "TBT slack share before VLT grows (default %(default)s)")
    xfer_budget: int | None = _flag(
        None,
        "B_xfer: KV blocks that may be copied per step (default: what the worker's measured copy "
        f"bandwidth moves in half the TBT SLO; {DEFAULT_XFER_BUDGET}, the paper's, without a measurement)",
        type=int,
    )
    max_batched_tokens: int = _flag(512, "chunked-prefill token budget per step, decodes first (default %(default)s)")
    slo_chunking: bool | None = _flag(
        None,
        "any policy: while requests decode, cap a step's prefill tokens so that its compute time (fitted from "
        "the worker's reports) stays within their TBT SLO, as long as the prompts' TTFT slack can pay for "
        "it (default: lvf's, on with a GPU worker, off with a CPU one, whose decode step alone costs most "
        "of the SLO; off for the other policies)",
        type=bool,
    )
    max_num_seqs: int = _flag(64, "requests per step at most (default %(default)s)")
    max_waiting: int = _flag(  # WAITING requests (no KV yet)
        0, "requests waiting for their first schedule at most; beyond it new ones get 429 (0 = unbounded)"
    )
    max_waiting_tokens: int = _flag(  # their known tokens (prompt + generated)
        0,
        "known tokens (prompt + generated) of the waiting requests at most; a new request that would "
        "pass it gets 429, unless none is waiting (0 = unbounded)",
    )
    block_size: int = DEFAULT_BLOCK_SIZE  # the worker's: the service takes it from WorkerReady
    eager_rotation: bool = _flag(
        True,
        "lvf: mirror running requests' synced KV blocks to DRAM ahead of preemption, so that a "
        "preemption copies little (default %(default)s)",
    )
    mirror_watermark: float | None = _flag(
        None,
        "lvf: mirror only while the scheduled requests' KV passes this share of the HBM blocks (default: "
        "0, always, with a GPU worker, whose copy engine is idle otherwise; 0.5 with a CPU worker, whose "
        "copies take the cores' time)",
        type=float,
    )
    reserve_full_prompt: bool = _flag(
        True,
        "admit a paused request only with HBM room for all its known tokens, not just the chunk it "
        "computes first (default %(default)s)",
    )
    enable_prefix_caching: bool = _flag(
        True,
        "share the KV blocks of prompt prefixes between requests and keep freed ones cached until "
        "their space is needed (default %(default)s)",
    )
    kv_offloading_size: float = _flag(
        0.0,
        "GiB of the DRAM pool that keep KV blocks which left HBM (finished requests, evicted cached "
        "blocks) for later prefix hits, least recently used first out; rotated requests always win the "
        "space (vLLM's flag; 0 = off, default %(default)s)",
    )
    tier_loads: str | None = _flag(
        None,
        "how prefix blocks found in DRAM come back: slo: per request and step, load them, recompute them "
        "or load the head and recompute the tail, by the copy bandwidth, the prefill time and the TTFT "
        "slack; all: load every hit (vLLM's offloading connector) (default: slo with lvf, all otherwise)",
        choices=("slo", "all"),
        type=str,
    )
    # The worker's, not flags: one KV block in bytes and the DRAM->HBM copy bandwidth it measured
    # at start (the service takes both from WorkerReady; the simulator from its cost model).
    block_bytes: int = 0
    copy_gbps: float = 0.0
    # lvf's guards against a carousel of rotations (lvf.py): a paused request that has emitted
    # tokens displaces only requests that have run `min_residency_s`, and one it cannot place
    # does not hold back the requests behind it (`rotary_yields`); admissions leave
    # `admit_watermark` of HBM free for the running requests' next blocks.
    min_residency_s: float = _flag(
        16.0,
        "lvf: a paused request that has emitted tokens preempts only requests that have run this "
        "long since put on the GPU, in seconds (default %(default)s)",
    )
    admit_watermark: float | None = _flag(
        None,
        "any policy: share of the HBM blocks a paused request may not take when others run and HBM "
        "cannot hold every live request: room for their growth, which would otherwise preempt one of "
        f"them (default: {LVF_WATERMARK} for lvf, 0 for the other policies)",
        type=float,
    )
    rotary_yields: bool = _flag(
        True,
        "lvf: a paused request that has emitted tokens and cannot be placed does not hold back the "
        "requests behind it (default %(default)s)",
    )

    @classmethod
    def flag_fields(cls) -> list[Field]:
        """The knobs the command line sets, in the order of their flags."""
        return [f for f in fields(cls) if "help" in f.metadata]

    @classmethod
    def from_flags(cls, args) -> SchedulerConfig:
        """The config that parsed flags ask for (`args.<field>` of every flag field); the
        service and the simulator's replay of a live server both build theirs here."""
        return cls(**{f.name: getattr(args, f.name) for f in cls.flag_fields()})

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r} (one of {', '.join(POLICIES)})")
        if self.admit_watermark is None:
            self.admit_watermark = LVF_WATERMARK if self.policy == "lvf" else 0.0
        if self.policy == "lvf-paper":  # the paper's LVF: none of our guards
            self.min_residency_s, self.admit_watermark, self.rotary_yields = 0.0, 0.0, False
            self.slo_chunking = False
        if self.policy == "superinfer-artifact":  # its vLLM 0.6.6 allocates a new request's chunk only
            self.reserve_full_prompt = False
        for name in ("block_size", "max_batched_tokens", "max_num_seqs", "xfer_budget"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.alpha <= 0 or self.ttft_slo <= 0 or self.tbt_slo <= 0:
            raise ValueError("alpha and the SLOs must be > 0")
        if self.min_residency_s < 0:
            raise ValueError("min_residency_s must be >= 0")
        if not 0 <= self.admit_watermark < 1:
            raise ValueError("admit_watermark must be in [0, 1)")
        if self.mirror_watermark is not None and not 0 <= self.mirror_watermark <= 1:
            raise ValueError("mirror_watermark must be in [0, 1]")
        if self.kv_offloading_size < 0 or self.copy_gbps < 0 or self.block_bytes < 0:
            raise ValueError("kv_offloading_size, copy_gbps and block_bytes must be >= 0")
        if self.tier_loads not in (None, "slo", "all"):
            raise ValueError(f"unknown tier_loads {self.tier_loads!r} (slo or all)")
        if self.max_waiting < 0 or self.max_waiting_tokens < 0:
            raise ValueError("max_waiting and max_waiting_tokens must be >= 0")

    def admission_refusal(self, num_waiting: int, num_waiting_tokens: int, num_tokens: int) -> str | None:
        """Why a new request of `num_tokens` known tokens is refused as overloaded, or None.

        The bounds cap the backlog of requests without KV (`num_waiting` of them holding
        `num_waiting_tokens`), so a burst turns into quick 429s instead of TTFTs no SLO
        survives. A request alone in the queue is admitted whatever its size: the token
        bound limits the backlog, not the prompt (the context window does that), and a
        refusal no retry could ever turn into an admission would not be an overload.
        """
        if self.max_waiting and num_waiting >= self.max_waiting:
            return f"{num_waiting} requests are waiting (bound: {self.max_waiting}); try again later"
        total = num_waiting_tokens + num_tokens
        if self.max_waiting_tokens and num_waiting and total > self.max_waiting_tokens:
            return (
                f"{num_waiting} waiting requests hold {num_waiting_tokens} tokens; with this one's {num_tokens} "
                f"that is {total}, over the bound of {self.max_waiting_tokens} waiting tokens; try again later"
            )
        return None

    @property
    def swaps(self) -> bool:
        """Whether preemption copies KV to DRAM (else it is dropped and recomputed)."""
        return self.policy in SWAPPING

    @property
    def mirrors(self) -> bool:
        """Whether synced blocks are mirrored to DRAM ahead of preemption (above the
        `mirror_watermark`)."""
        return self.is_lvf and self.eager_rotation

    def for_device(self, on_cpu: bool) -> SchedulerConfig:
        """This config with the knobs left to the worker's device (None) set for it."""
        return replace(
            self,
            mirror_watermark=default_mirror_watermark(on_cpu) if self.mirror_watermark is None else self.mirror_watermark,
            slo_chunking=(default_slo_chunking(on_cpu) and self.policy == "lvf")
            if self.slo_chunking is None
            else self.slo_chunking,
        )

    def for_worker(self, block_bytes: int, copy_gbps: float) -> SchedulerConfig:
        """This config with the worker's block bytes and measured copy bandwidth. B_xfer not given
        becomes what this machine's link copies in XFER_SHARE of the TBT SLO (the paper's 2400
        blocks are about that on GH200, Qwen2.5-32B); one given is kept, whatever its value."""
        budget = self.xfer_budget
        if copy_gbps > 0 and block_bytes > 0 and budget is None:
            budget = max(1, int(copy_gbps * 1e9 * XFER_SHARE * self.tbt_slo / block_bytes))
        return replace(self, block_bytes=block_bytes, copy_gbps=copy_gbps, xfer_budget=budget)

    @property
    def b_xfer(self) -> int:
        """B_xfer: `xfer_budget`, the paper's figure while neither given nor measured."""
        return DEFAULT_XFER_BUDGET if self.xfer_budget is None else self.xfer_budget

    @property
    def tier_mode(self) -> str | None:
        """How DRAM prefix hits are brought back ("slo" or "all"); None without the DRAM tier."""
        if self.kv_offloading_size <= 0 or not self.enable_prefix_caching:
            return None
        return self.tier_loads or ("slo" if self.policy == "lvf" else "all")

    @property
    def caps_prefill(self) -> bool:
        """Whether a step's prefill tokens are capped to keep decodes within their TBT SLO."""
        return bool(self.slo_chunking)

    @property
    def is_lvf(self) -> bool:
        """lvf or lvf-paper: LVF's step while HBM cannot hold every live request."""
        return self.policy in LVF_POLICIES
