"""`superinfer bench chaos`'s verdict (chaos.py runs the load): how each request ended, and
how long each fault took to recover from. Pure functions of the client's records."""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from dataclasses import asdict, dataclass

from bench.live.chaos_rig import Fault
from bench.live.soak import chunk_times
from bench.report.metrics import RequestRecord

RSS_GOAL_PCT = 5.0
# Answers that refuse a request at the door (never accepted): admission bounds, nothing ready
# to serve it, no gateway listening. A 503 later on ("its scheduler was lost ...") is a failure.
REFUSALS = ("HTTP 429", "no model worker is ready", "no scheduler is reachable", "ClientConnectorError")
# A connection cut under an accepted request (its gateway died): an OpenAI client retries these.
CUTS = ("ServerDisconnectedError", "ClientPayloadError", "ClientOSError")


def completed(r: RequestRecord) -> bool:
    return r.ok and r.output_tokens == r.expected_output_tokens


def refused(r: RequestRecord) -> bool:
    return r.ttft_s is None and any(x in (r.error or "") for x in REFUSALS)


def classify(r: RequestRecord, num_retries: int = 0) -> str:
    """completed, refused (at the door: never accepted) or failed; a request that was retried
    had been accepted (its first connection was cut), whatever its retries met."""
    if completed(r):
        return "completed"
    return "refused" if refused(r) and not num_retries else "failed"


def reason(r: RequestRecord, num_retries: int = 0) -> str:
    """The failure as the client was told it, ids and numbers left out so that alike ones group."""
    err = r.error or f"finished with {r.output_tokens} of {r.expected_output_tokens} tokens"
    if num_retries:
        err = f"connection cut (its gateway killed), {num_retries} client retries, the last: {err}"
    return re.sub(r"(cmpl|chatcmpl)-[0-9a-f]+(~\d+)?", "<id>", err)[:200]


def is_cut(r: RequestRecord) -> bool:
    return any((r.error or "").startswith(c) for c in CUTS)


@dataclass
class Sent:
    """One request of the load: its last attempt's record, how many retries it took, when it
    was first sent and when it ended (seconds from the phase's start)."""

    record: RequestRecord
    num_retries: int = 0
    first_start_s: float = 0.0
    end_s: float = 0.0


def stalled(fault: Fault, sent: list[Sent], stall_s: float) -> list[Sent]:
    """The requests open at the fault's start, or sent while it lasted or within `stall_s` of
    its end (before the server could notice it: a kill lasts no time), that were silent across
    it for over `stall_s`: from their last chunk before it (or their first sending) to their
    first chunk after it (or their end)."""
    out = []
    for s in sent:
        if s.first_start_s > fault.end_s + stall_s or s.end_s <= fault.start_s:
            continue
        times = chunk_times(s.record)
        before = [t for t in times if t <= fault.start_s] or [s.first_start_s]
        after = [t for t in times if t > fault.start_s] or [s.end_s]
        if after[0] - before[-1] > stall_s:
            out.append(s)
    return out


def recovery(fault: Fault, next_start_s: float, sent: list[Sent], stall_s: float) -> dict:
    """This fault's recovery (chaos.py's docstring, 5): seconds from its end until the first
    and until the last stream it stalled flowed again, counting only chunks before the next
    fault's start; `unrecovered` streams never flowed again before it (None then for `all_s`,
    and for `first_s` when none did)."""
    streams = stalled(fault, sent, stall_s)
    resumed, unrecovered = [], 0
    for s in streams:
        t = next((t for t in chunk_times(s.record) if t > fault.end_s), None)
        if t is None or t > next_start_s:
            unrecovered += 1
        else:
            resumed.append(t - fault.end_s)
    return {
        "stalled": len(streams),
        "unrecovered": unrecovered,
        "first_s": (min(resumed) if resumed else None) if streams else 0.0,
        "all_s": (max(resumed, default=0.0) if not unrecovered else None),
    }


def spread(values: list[float | None]) -> tuple[float | None, float | None]:
    """(p50, max), a None (unrecovered) counting as slower than any; None where that decides."""
    if not values:
        return None, None
    ordered = [math.inf if v is None else v for v in values]
    p50, worst = statistics.median(ordered), max(ordered)
    return (None if math.isinf(p50) else p50), (None if math.isinf(worst) else worst)


def tally(items, sent: list[Sent], texts, reference, pool_index, faults, stall_s, end_s: float) -> dict:
    records = [s.record for s in sent]
    kinds = [classify(s.record, s.num_retries) for s in sent]
    done = [i for i, k in enumerate(kinds) if k == "completed"]
    differ = [i for i in done if texts[i] != reference[pool_index[i]]]
    mismatches = [{"request": i, "prompt": pool_index[i], "start_s": round(records[i].start_s, 2),
                   "text": texts[i], "reference": reference[pool_index[i]]} for i in differ]  # fmt: skip
    starts = [f.start_s for f in faults[1:]] + [end_s]
    recov = {f"{f.kind}@{f.start_s:.0f}s": recovery(f, n, sent, stall_s) for f, n in zip(faults, starts, strict=True)}
    first_p50, first_max = spread([v["first_s"] for v in recov.values()])
    all_p50, all_max = spread([v["all_s"] for v in recov.values()])
    return {
        "sent": len(records),
        "accepted": len(records) - kinds.count("refused"),
        "refused": kinds.count("refused"),
        "completed": len(done),
        "completed_after_client_retry": sum(sent[i].num_retries > 0 for i in done),
        "failed": kinds.count("failed"),
        "identical": len(done) - len(differ),
        "mismatches": mismatches,
        "failures": dict(Counter(reason(s.record, s.num_retries) for s, k in zip(sent, kinds) if k == "failed").most_common()),
        "refusals": dict(Counter(reason(r) for r, k in zip(records, kinds) if k == "refused").most_common()),
        "faults_by_kind": dict(Counter(f.kind for f in faults)),
        "faults": [asdict(f) for f in faults],
        "recovery": recov,
        "recovery_p50_s": first_p50,
        "recovery_max_s": first_max,
        "recovery_all_p50_s": all_p50,
        "recovery_all_max_s": all_max,
        "faults_unrecovered": sum(v["first_s"] is None for v in recov.values()),
        "faults_with_unrecovered_streams": sum(v["unrecovered"] > 0 for v in recov.values()),
    }


def goals(r: dict) -> dict[str, bool]:
    acc = max(1, r["accepted"])
    return {
        "every accepted request ended": r["completed"] + r["failed"] == r["accepted"]
        and "still open after the drain timeout" not in r["failures"],
        ">= 99% completed": r["completed"] / acc >= 0.99,
        "completed identical": r["identical"] == r["completed"],
        "zero leaked blocks": r["leaked_blocks"] == 0 and r["live_requests_at_idle"] == 0,
        f"memory within {RSS_GOAL_PCT:g}%": r["rss_growth_pct"] is not None and abs(r["rss_growth_pct"]) <= RSS_GOAL_PCT,
        "recovery p50 <= 5 s": r["recovery_p50_s"] is not None and r["recovery_p50_s"] <= 5.0,
    }
