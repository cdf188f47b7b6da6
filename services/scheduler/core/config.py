"""Scheduler configuration: policy, budgets and the VLT constants."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("lvf", "fcfs", "sf", "wf")


@dataclass
class SchedulerConfig:
    """Knobs of the scheduler core. Times are seconds, sizes are tokens or blocks.

    `xfer_budget` (B_xfer) caps the KV blocks copied in one step, swap-ins, swap-outs and
    eager mirrors together: it ties the policy to the link bandwidth.
    """

    policy: str = "lvf"  # lvf | fcfs | sf | wf
    block_size: int = 16
    max_batched_tokens: int = 512  # chunked-prefill token budget per step (decodes first)
    max_num_seqs: int = 64  # requests per step
    alpha: float = 3.0
    beta_b: float = 0.0
    beta_f: float = 0.5
    ttft_slo: float = 5.0
    tbt_slo: float = 0.1
    xfer_budget: int = 2400  # B_xfer: blocks moved per step at most
    eager_rotation: bool = True
    max_waiting: int = 0  # WAITING requests (no KV yet) at most; 0 = unbounded
    max_waiting_tokens: int = 0  # their known tokens (prompt + generated) at most; 0 = unbounded

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r} (one of {', '.join(POLICIES)})")
        for name in ("block_size", "max_batched_tokens", "max_num_seqs", "xfer_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.alpha <= 0 or self.ttft_slo <= 0 or self.tbt_slo <= 0:
            raise ValueError("alpha and the SLOs must be > 0")
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
        return self.policy != "fcfs"

    @property
    def mirrors(self) -> bool:
        """Whether synced blocks are mirrored to DRAM ahead of preemption."""
        return self.policy == "lvf" and self.eager_rotation
