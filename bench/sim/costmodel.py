"""The simulator's worker: how long a step computes and how long its KV copies take.

Two ways to price a step's compute, chosen by the hardware profile:
- roofline (GPU profiles): weights read once per step, KV read by attention and written for
  new tokens, against FLOPs of the linear layers (2·params per token, logits only for rows
  that sample) and of attention; time = max(FLOPs / achievable FLOP/s, bytes / achievable
  HBM bandwidth) + a fixed per-step overhead. MoE reads only the experts some token routes
  to and computes only the active ones;
- linear (the `cpu` profile, fitted by `bench calibrate` on the real worker): overhead +
  per prefill token + per decode token + per KV token read. `bench simlive` fits the same
  four terms on the steps of a live served run instead (the `cpu-live` profile).

Two more terms carry what a client of the live server sees beyond compute and copies; both are
measured on the live server by `bench simlive` (from a calibration trace, not the one it
evaluates) and are 0 in a profile that has not measured them:
- `step_gap_ms`: worker time per step beyond its compute (result out, next plan in, request
  bookkeeping), charged between consecutive steps;
- `client_latency_ms`: what a client sees on top of the scheduler's token times (HTTP,
  tokenization, the socket hops and SSE), added to each request's TTFT.

Copies are priced from the bytes moved, the link's efficiency at the copy's segment size
(interpolated on log size) and the transfer mode: `naive` copies one layer's K or V of one
block at a time, `merged` one block, `batched` one call per direction; all three run the
two directions in series. `duplex` runs both directions at once, together capped by the
host DRAM bandwidth. `vllm` is vLLM's swap path: `naive`'s copies, and the step's compute
waits for all of them (engine.py: the worker swaps before it runs the model).

Profiles live in bench/profiles/*.json; model shapes are below.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from shared import config

PROFILE_DIR = Path(__file__).resolve().parents[1] / "profiles"
MODES = ("naive", "merged", "batched", "duplex")  # the transfer engine's (services/worker/transfer.py)
SIM_MODES = (*MODES, "vllm")  # and vLLM's swap path, for its baselines
GB = 1e9


# ---------------------------------------------------------------- model shapes


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool = False
    num_experts: int = 1  # MLP experts per layer (1 = dense)
    num_active_experts: int = 1  # experts each token is routed to
    max_position: int = 32768

    @property
    def attn_params(self) -> int:
        """q, k, v, o projections of one layer."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return self.hidden_size * (2 * q + 2 * kv)

    @property
    def expert_params(self) -> int:
        """gate, up, down of one expert of one layer."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        per_layer = self.attn_params + self.num_experts * self.expert_params + 2 * self.hidden_size
        router = self.hidden_size * self.num_experts if self.num_experts > 1 else 0
        heads = 1 if self.tie_embeddings else 2
        return self.num_layers * (per_layer + router) + heads * self.embed_params

    @property
    def active_layer_params(self) -> int:
        """Parameters of the layers one token multiplies (embeddings and logits aside)."""
        return self.num_layers * (self.attn_params + self.num_active_experts * self.expert_params)

    def kv_token_bytes(self, dtype_bytes: int) -> int:
        """K and V of one token, all layers."""
        return self.kv_block_bytes(1, dtype_bytes)

    def kv_segment_bytes(self, block_size: int, dtype_bytes: int) -> int:
        """One layer's K (or V) of one block: what a layer-first layout copies at a time."""
        return config.kv_segment_bytes(self.num_kv_heads, self.head_dim, block_size, dtype_bytes)

    def kv_block_bytes(self, block_size: int, dtype_bytes: int) -> int:
        return config.kv_block_bytes(self.num_layers, self.num_kv_heads, self.head_dim, block_size, dtype_bytes)

    def weights_read(self, num_tokens: int) -> int:
        """Parameters read by a step of `num_tokens` tokens: everything but the experts no
        token routes to (expected distinct experts under uniform top-k routing)."""
        if self.num_experts == 1 or num_tokens == 0:
            return self.num_params
        e, k = self.num_experts, self.num_active_experts
        touched = e * (1.0 - (1.0 - k / e) ** num_tokens)
        return int(self.num_params - self.num_layers * (e - touched) * self.expert_params)


MODELS: dict[str, ModelShape] = {
    "smollm2": ModelShape("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, tie_embeddings=True, max_position=8192),
    "llama3-8b": ModelShape("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256, max_position=8192),
    "qwen2.5-32b": ModelShape("Qwen2.5-32B", 64, 5120, 40, 8, 128, 27648, 152064, max_position=32768),
    "mixtral-8x7b": ModelShape(
        "Mixtral-8x7B", 32, 4096, 32, 8, 128, 14336, 32000, num_experts=8, num_active_experts=2, max_position=32768
    ),
}


# ---------------------------------------------------------------- hardware profiles


@dataclass(frozen=True)
class Link:
    """HBM<->DRAM link: per-direction rate vs segment size, and the duplex cap."""

    curve: tuple[tuple[float, float], ...]  # (segment bytes, GB/s per direction), ascending
    dram_gbs: float  # host DRAM bandwidth, both directions together (the ideal duplex cap)
    duplex_efficiency: float = 1.0  # share of dram_gbs two concurrent directions reach

    def rate(self, segment_bytes: float) -> float:
        """Bytes/s of one direction copying segments of `segment_bytes`: linear in log size
        between curve points, flat beyond the ends."""
        sizes = [s for s, _ in self.curve]
        if segment_bytes <= sizes[0]:
            return self.curve[0][1] * GB
        if segment_bytes >= sizes[-1]:
            return self.curve[-1][1] * GB
        i = bisect.bisect_right(sizes, segment_bytes)
        (s0, r0), (s1, r1) = self.curve[i - 1], self.curve[i]
        frac = (math.log(segment_bytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return (r0 + frac * (r1 - r0)) * GB

    @property
    def duplex_cap(self) -> float:
        return self.dram_gbs * self.duplex_efficiency * GB


@dataclass(frozen=True)
class LinearCost:
    """Calibrated step time of one model on one machine (seconds)."""

    model: str
    overhead_s: float
    prefill_token_s: float
    decode_token_s: float
    kv_token_s: float


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float  # peak dense FLOP/s at the serving dtype
    hbm_bw: float  # bytes/s
    hbm_bytes: float
    host_bytes: float
    link: Link
    compute_efficiency: float = 0.6
    hbm_efficiency: float = 0.8
    step_overhead_s: float = 0.003
    sched_s: float = 0.0  # modelled time of one scheduling call
    pipeline: bool = True  # plan t+1 and its copies overlap step t's compute
    dtype_bytes: int = 2  # weights and KV
    mem_utilization: float = 0.9  # share of HBM the serving process may use
    dram_fraction: float = 0.5  # share of host memory given to the DRAM KV pool
    kv_hbm_bytes: float | None = None  # HBM KV pool size when fixed (cpu: a RAM share)
    kv_dram_bytes: float | None = None
    linear: LinearCost | None = None
    step_gap_s: float = 0.0  # worker time between two busy steps, beyond compute
    client_latency_s: float = 0.0  # client-side TTFT beyond the scheduler's
    defaults: dict = field(default_factory=dict)  # scheduler defaults for this machine
    notes: str = ""


def hardware_from_dict(d: dict) -> Hardware:
    link = d["link"]
    lin = d.get("linear")
    return Hardware(
        name=d["name"],
        flops=float(d.get("flops_tera", 0.0)) * 1e12,  # a linear (calibrated) profile needs none
        hbm_bw=float(d.get("hbm_gbs", 0.0)) * GB,
        hbm_bytes=float(d.get("hbm_gb", 0.0)) * GB,
        host_bytes=float(d.get("host_gb", 0.0)) * GB,
        link=Link(
            tuple((float(s), float(r)) for s, r in link["curve"]),
            float(link["dram_gbs"]),
            float(link.get("duplex_efficiency", 1.0)),
        ),
        compute_efficiency=float(d.get("compute_efficiency", 0.6)),
        hbm_efficiency=float(d.get("hbm_efficiency", 0.8)),
        step_overhead_s=float(d.get("step_overhead_ms", 3.0)) / 1e3,
        sched_s=float(d.get("sched_ms", 0.0)) / 1e3,
        pipeline=bool(d.get("pipeline", True)),
        dtype_bytes=int(d.get("dtype_bytes", 2)),
        mem_utilization=float(d.get("mem_utilization", 0.9)),
        dram_fraction=float(d.get("dram_fraction", 0.5)),
        kv_hbm_bytes=_opt_gb(d.get("kv_hbm_gb")),
        kv_dram_bytes=_opt_gb(d.get("kv_dram_gb")),
        linear=LinearCost(**lin) if lin else None,
        step_gap_s=float(d.get("step_gap_ms", 0.0)) / 1e3,
        client_latency_s=float(d.get("client_latency_ms", 0.0)) / 1e3,
        defaults=dict(d.get("defaults", {})),
        notes=d.get("notes", ""),
    )


def _opt_gb(v) -> float | None:
    return None if v is None else float(v) * GB


def load_hardware(name_or_path: str) -> Hardware:
    """A profile by name (bench/profiles/NAME.json) or by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.json"
    if not path.is_file():
        hint = " (run `superinfer bench calibrate` first)" if name_or_path == "cpu" else ""
        raise FileNotFoundError(f"no hardware profile {name_or_path!r} at {path}{hint}")
    return hardware_from_dict(json.loads(path.read_text()))


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


# ---------------------------------------------------------------- KV pool sizes


def check_pair(hw: Hardware, model_key: str) -> None:
    """A calibrated profile prices only the model it was measured with."""
    if hw.linear is not None and hw.linear.model != model_key:
        raise ValueError(f"profile {hw.name!r} was calibrated on {hw.linear.model!r}, not {model_key!r}")


def num_kv_blocks(hw: Hardware, model: ModelShape, block_size: int) -> tuple[int, int]:
    """(HBM blocks, DRAM blocks): HBM = (capacity × utilization − weights) / block bytes,
    DRAM = host memory × dram_fraction / block bytes (fixed sizes in the profile win)."""
    block = model.kv_block_bytes(block_size, hw.dtype_bytes)
    hbm = hw.kv_hbm_bytes
    if hbm is None:
        hbm = hw.hbm_bytes * hw.mem_utilization - model.num_params * hw.dtype_bytes
    dram = hw.kv_dram_bytes if hw.kv_dram_bytes is not None else hw.host_bytes * hw.dram_fraction
    if hbm < block:
        raise ValueError(f"{model.name} does not fit on {hw.name}: no HBM left for the KV-cache")
    return int(hbm // block), int(dram // block)


# ---------------------------------------------------------------- step compute


@dataclass
class StepWork:
    """What one step computes, summed over its scheduled requests."""

    num_prefill_tokens: int = 0  # tokens of chunks longer than one
    num_decode_tokens: int = 0  # one-token chunks
    num_kv_read: int = 0  # context tokens attention reads (all layers count once)
    num_attn_pairs: int = 0  # (query, key) pairs attention scores
    num_sampled: int = 0  # rows that produce logits

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    def add(self, num_computed: int, num_new: int, samples: bool) -> None:
        """A request computing positions [num_computed, num_computed + num_new)."""
        if num_new == 1:
            self.num_decode_tokens += 1
        else:
            self.num_prefill_tokens += num_new
        self.num_kv_read += num_computed + num_new
        # query at position p attends to p + 1 keys
        self.num_attn_pairs += num_new * num_computed + num_new * (num_new + 1) // 2
        self.num_sampled += samples


def host_attention_time(hw: Hardware, model: ModelShape, num_kv_tokens: int) -> float:
    """Seconds the host CPU takes for decode attention over `num_kv_tokens` of KV in its DRAM
    (NEO's offloaded attention): memory-bound, reading the KV once at the DRAM's bandwidth
    with the efficiency the GPU's memory-bound kernels reach."""
    return num_kv_tokens * model.kv_token_bytes(hw.dtype_bytes) / (hw.link.dram_gbs * GB * hw.hbm_efficiency)


def neo_applicable(model: ModelShape) -> bool:
    """Whether NEO runs `model`: its engine (swiftLLM) has dense Llama-style models only, no
    MoE, so a reproduction has no NEO row for an MoE model."""
    return model.num_experts == 1


def neo_host_share(num_used: int, num_hbm_blocks: int) -> float:
    """The share of NEO's live KV that lies in host DRAM: what does not fit in HBM."""
    return max(0, num_used - num_hbm_blocks) / max(num_used, 1)


def neo_prompt_copy_blocks(num_prefill_tokens: int, host_share: float, block_size: int) -> int:
    """KV blocks a NEO step copies device -> host for the prompts it prefilled: NEO prefills
    every prompt on the GPU, and a request it decodes on the CPU has its prompt's KV copied
    to host memory (its `pref_to_cpu` requests). Their share of the step's prefill tokens
    is taken as the host's share of the KV."""
    return -(-round(num_prefill_tokens * host_share) // block_size)


def neo_host_blocks(hw: Hardware, model: ModelShape, num_hbm_blocks: int, block_size: int) -> int:
    """The KV blocks NEO keeps in host DRAM, as its load-aware scheduling sizes them: as many as
    the CPU's attention reads in the time the GPU's decode step takes with HBM full of KV (so
    the offloaded attention hides behind the GPU's work in its asymmetric pipeline)."""
    num_kv = num_hbm_blocks * block_size
    gpu_s = compute_time(hw, model, StepWork(num_decode_tokens=1, num_kv_read=num_kv))
    return int(gpu_s / host_attention_time(hw, model, block_size))


def compute_time(hw: Hardware, model: ModelShape, work: StepWork) -> float:
    """Seconds of one step's forward; 0 when it computes nothing."""
    if work.num_tokens == 0:
        return 0.0
    if hw.linear is not None:
        lin = hw.linear
        return (
            lin.overhead_s
            + lin.prefill_token_s * work.num_prefill_tokens
            + lin.decode_token_s * work.num_decode_tokens
            + lin.kv_token_s * work.num_kv_read
        )
    flops = (
        2 * model.active_layer_params * work.num_tokens
        + 2 * model.embed_params * work.num_sampled
        + 4 * model.num_layers * model.num_heads * model.head_dim * work.num_attn_pairs
    )
    kv = model.kv_token_bytes(hw.dtype_bytes)
    num_bytes = model.weights_read(work.num_tokens) * hw.dtype_bytes + kv * (work.num_kv_read + work.num_tokens)
    t_compute = flops / (hw.flops * hw.compute_efficiency)
    t_memory = num_bytes / (hw.hbm_bw * hw.hbm_efficiency)
    return max(t_compute, t_memory) + hw.step_overhead_s


# ---------------------------------------------------------------- copies


@dataclass(frozen=True)
class XferTime:
    in_s: float  # swap-ins done (compute reading them may start)
    total_s: float  # both directions done (the link is free again)


def direction_rate(hw: Hardware, model: ModelShape, mode: str, num_blocks: int, block_size: int) -> float:
    """Bytes/s of one direction copying `num_blocks` blocks alone in `mode`."""
    if mode not in SIM_MODES:
        raise ValueError(f"unknown transfer mode {mode!r}; one of {', '.join(SIM_MODES)}")
    if mode in ("naive", "vllm"):
        segment = model.kv_segment_bytes(block_size, hw.dtype_bytes)
    elif mode == "merged":
        segment = model.kv_block_bytes(block_size, hw.dtype_bytes)
    else:  # one call per direction
        segment = num_blocks * model.kv_block_bytes(block_size, hw.dtype_bytes)
    return hw.link.rate(segment)


def transfer_time(hw: Hardware, model: ModelShape, mode: str, num_in: int, num_out: int, block_size: int) -> XferTime:
    """Time of one step's copies: `num_in` blocks DRAM→HBM, `num_out` HBM→DRAM."""
    block = model.kv_block_bytes(block_size, hw.dtype_bytes)
    bytes_in, bytes_out = num_in * block, num_out * block
    r_in = direction_rate(hw, model, mode, num_in, block_size) if num_in else 1.0
    r_out = direction_rate(hw, model, mode, num_out, block_size) if num_out else 1.0
    if mode != "duplex":
        t_in = bytes_in / r_in
        return XferTime(t_in, t_in + bytes_out / r_out)
    return _duplex(bytes_in, bytes_out, r_in, r_out, hw.link.duplex_cap)


def _duplex(bytes_in: float, bytes_out: float, r_in: float, r_out: float, cap: float) -> XferTime:
    """Both directions at once: while both run, their rates scale down to share `cap`;
    when one is done the other runs alone (still within `cap`)."""
    if not bytes_in or not bytes_out:
        t_in = bytes_in / min(r_in, cap)
        return XferTime(t_in, t_in + bytes_out / min(r_out, cap))
    scale = min(1.0, cap / (r_in + r_out))
    s_in, s_out = r_in * scale, r_out * scale
    t_both = min(bytes_in / s_in, bytes_out / s_out)
    left_in, left_out = bytes_in - s_in * t_both, bytes_out - s_out * t_both
    t_in = t_both + left_in / min(r_in, cap)
    t_out = t_both + left_out / min(r_out, cap)
    return XferTime(t_in, max(t_in, t_out))


def ideal_time(hw: Hardware, bytes_in: float, bytes_out: float) -> float:
    """The link's lower bound: every byte at the DRAM's full both-ways bandwidth."""
    return (bytes_in + bytes_out) / (hw.link.dram_gbs * GB)
