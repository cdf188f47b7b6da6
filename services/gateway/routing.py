"""Where each new request goes (`--routing`): `cache-aware` (the default) sends it where its
first token is predicted soonest, counting the prefix each scheduler already holds;
`headroom` by SLO headroom alone (headroom.py); `round-robin` in turn.

The gateway's copy of each scheduler's prefix cache (`LinkCache`) is fed by the scheduler's
own load reports: the block keys (`protocol.block_key`) it gained and dropped in HBM and in
DRAM since the previous report (services/scheduler/cache_report.py), numbered by `cache_seq`.
A report out of sequence (one was lost) or a new scheduler instance drops the copy — its
entries are not trusted — and the next hello asks for a snapshot. A prompt is named the way
the scheduler names it, by the same function (`prefix.extend_hashes`, salted with the model's
name, in the scheduler's block size).

Why events from the schedulers rather than an index of what this gateway sent where: only the
scheduler knows what it evicted, what moved to its DRAM tier (a hit there costs a copy, not a
prefill) and what other gateways sent it; a gateway-side index guesses all three. The events
cost little (`bench replicas`, gh200, ShareGPT conversations, 8/s per replica): about 9 bytes
an event, 100-550 events/s per replica (1-5 kB/s on the report channel, ~100 kB/s at 32
replicas), an index of ~90 bytes an entry (20 MiB for 32 replicas' caches), against the sent-
index's ~150 inserts/s per replica, which it would save. Its CPU is the prompt's hashing, the
same chain the scheduler computes (~4 µs a 16-token block here), and a lookup per scheduler.

The score, for a prompt of P tokens whose first H blocks a scheduler holds (D of them in DRAM):

    ttft ≈ steps · (a + b · num_running) + b · tokens + D · block_copy_s
    tokens = num_queued_tokens + unreported_tokens + max(0, P − H · block_size)
    steps  = ⌈tokens / max_batched_tokens⌉

(a, b: the scheduler's fitted step time and prefill time per token; queued tokens: prompts
waiting there, plus what this gateway sent since its last report). The lowest wins; near-equal
scores (within TIE_S) take turns. A scheduler short of SLO headroom (`headroom_score` ≥
SHORT_OF_HEADROOM: a request left out of its last step, or its batch and HBM as good as full)
is chosen only when every one is. A session (the OpenAI `user` field or an `x-session-id`
header) goes back to its scheduler while that one has headroom.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from functools import lru_cache

from services.scheduler.core.prefix import extend_hashes, root_hash
from shared.protocol import CacheEvents, SchedulerStats, block_key

ROUTINGS = ("cache-aware", "headroom", "round-robin")
DEFAULT_ROUTING = "cache-aware"
SHORT_OF_HEADROOM = 1.0  # a headroom_score from here: a queued request, or batch + HBM full
DEFAULT_PREFILL_S_PER_TOKEN = 1e-3  # until a scheduler's step-time model has a fit
UNFITTED = (0.0, DEFAULT_PREFILL_S_PER_TOKEN)  # (a, b) of a scheduler with no fit, while none has one
DEFAULT_BUDGET = 512
TIE_S = 1e-3  # predicted TTFTs closer than this are a tie
TIE_EPS = 1e-9  # headroom scores closer than this are a tie
MAX_SESSIONS = 65_536  # pinned sessions kept, least recently used out


@lru_cache(maxsize=16)
def _root(salt: str) -> bytes:
    return root_hash(salt)


def prompt_keys(tokens: list[int], block_size: int, salt: str) -> list[int]:
    """The block keys of `tokens`' full blocks, as the scheduler names them."""
    if block_size <= 0:
        return []
    hashes: list[bytes] = []
    extend_hashes(hashes, _root(salt), tokens, block_size, len(tokens) // block_size)
    return [block_key(h) for h in hashes]


class LinkCache:
    """One scheduler's cached blocks, as its reports told them (`seq` −1: not trusted, a
    snapshot is wanted)."""

    def __init__(self) -> None:
        self.hbm: set[int] = set()
        self.dram: set[int] = set()
        self.seq = -1
        self.num_events = 0  # applied, for the operator's and the benchmark's rates

    @property
    def wants_snapshot(self) -> bool:
        return self.seq < 0

    def forget(self) -> None:
        self.hbm.clear()
        self.dram.clear()
        self.seq = -1

    def on_report(self, seq: int, ev: CacheEvents | None) -> None:
        if ev is not None and ev.snapshot:
            self.hbm, self.dram, self.seq = set(ev.hbm_added), set(ev.dram_added), seq
            return
        if self.seq < 0:
            return  # waiting for the snapshot
        if ev is None:
            if seq != self.seq:
                self.forget()  # events were sent that we never saw
            return
        if seq != self.seq + 1:
            self.forget()
            return
        self.seq = seq
        self.hbm.difference_update(ev.hbm_removed)
        self.hbm.update(ev.hbm_added)
        self.dram.difference_update(ev.dram_removed)
        self.dram.update(ev.dram_added)
        self.num_events += len(ev.hbm_added) + len(ev.hbm_removed) + len(ev.dram_added) + len(ev.dram_removed)

    def match(self, keys: list[int]) -> tuple[int, int]:
        """(blocks of the chain's head held, of those in DRAM only)."""
        num_dram = 0
        for i, k in enumerate(keys):
            if k in self.hbm:
                continue
            if k in self.dram:
                num_dram += 1
                continue
            return i, num_dram
        return len(keys), num_dram


def predicted_ttft(
    stats: SchedulerStats, num_prompt: int, num_hit_blocks: int, num_dram_blocks: int, unreported_tokens: int = 0,
    unfitted: tuple[float, float] = UNFITTED,
) -> float:
    """Seconds to the first token of a `num_prompt`-token prompt on this scheduler (module doc);
    a scheduler with no fit yet is taken to step as `unfitted` says (a, b)."""
    a, b = (stats.step_s, stats.prefill_s_per_token) if stats.prefill_s_per_token else unfitted
    miss = max(0, num_prompt - num_hit_blocks * stats.block_size)
    tokens = stats.num_queued_tokens + unreported_tokens + miss
    steps = max(1, math.ceil(tokens / (stats.max_batched_tokens or DEFAULT_BUDGET)))
    return steps * (a + b * stats.num_running) + b * tokens + num_dram_blocks * stats.block_copy_s


class Sessions:
    """Session id -> the scheduler address it was last routed to (bounded, LRU)."""

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self.max_sessions = max_sessions
        self._addr: OrderedDict[str, str] = OrderedDict()

    def get(self, session: str | None) -> str | None:
        if session is None or (addr := self._addr.get(session)) is None:
            return None
        self._addr.move_to_end(session)
        return addr

    def pin(self, session: str | None, addr: str) -> None:
        if session is None:
            return
        self._addr[session] = addr
        self._addr.move_to_end(session)
        if len(self._addr) > self.max_sessions:
            self._addr.popitem(last=False)


class Router:
    """The choice among schedulers, without sockets or clock (the gateway's client and the
    simulator's replicas, bench/sim/replicas.py, both ask it). `links`: objects with the
    gateway's `SchedulerLink` view (`routable`, `score`, `short_of_headroom`, `predict`,
    `stats`, `addr`); `now`: the clock their `routable` reads. Each returns None when no link
    is routable."""

    def __init__(self, routing: str = DEFAULT_ROUTING) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"unknown routing {routing!r} (one of {', '.join(ROUTINGS)})")
        self.routing = routing
        self.sessions = Sessions()
        self.next = 0  # round-robin start: where the scan for the best link begins

    def pick(self, links: list, now: float, prompt_ids: list[int], session: str | None = None):
        if self.routing == "cache-aware":
            return self.soonest(links, now, prompt_ids, session)
        if self.routing == "round-robin":
            return self._lowest(links, lambda link: link.routable(now), lambda link: 0.0, 0.5)
        return self.best_headroom(links, now)

    def best_headroom(self, links: list, now: float):
        """The most SLO headroom (lowest `headroom_score`)."""
        return self._lowest(links, lambda link: link.routable(now), lambda link: link.score(), TIE_EPS)

    def soonest(self, links: list, now: float, prompt_ids: list[int], session: str | None):
        """The lowest predicted TTFT among schedulers with SLO headroom (all, when none has
        any); a session's own scheduler while it has headroom."""
        live = [link for link in links if link.routable(now)]
        roomy = [link for link in live if not link.short_of_headroom()]
        pinned = self.sessions.get(session)
        link = next((link for link in roomy if link.addr == pinned), None) if pinned else None
        if link is None:
            keys_by_layout: dict[tuple[int, str], list[int]] = {}
            # A scheduler without a fit (new, or idle so far) is taken to step as the slowest
            # fitted one does, neither faster nor slower than the others.
            fitted = [(x.stats.prefill_s_per_token, x.stats.step_s) for x in live if x.stats.prefill_s_per_token]
            unfitted = max(fitted)[::-1] if fitted else UNFITTED

            def ttft(link) -> float:
                layout = (link.stats.block_size, link.stats.model_name)
                if layout not in keys_by_layout:
                    keys_by_layout[layout] = prompt_keys(prompt_ids, *layout)
                return link.predict(len(prompt_ids), keys_by_layout[layout], unfitted)

            allowed = {id(x) for x in roomy or live}
            link = self._lowest(links, lambda x: id(x) in allowed, ttft, TIE_S)
            for other in live:  # the best's prediction is kept for on_sent; the others' are stale
                if other is not link:
                    other.predicted_miss = None
        if link is not None:
            self.sessions.pin(session, link.addr)
        return link

    def _lowest(self, links: list, ok, cost, tie: float):
        """The link passing `ok` of lowest `cost`; among those within `tie` of each other, the
        first from `self.next` in `links`' order (round-robin). One pass."""
        n = len(links)
        best, best_i, best_cost = None, 0, math.inf
        for k in range(n):
            i = (self.next + k) % n
            link = links[i]
            if ok(link) and (c := cost(link)) < best_cost - tie:
                best, best_i, best_cost = link, i, c
        if best is not None:
            self.next = (best_i + 1) % n
        return best
