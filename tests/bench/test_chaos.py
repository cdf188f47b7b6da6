"""`bench chaos`'s verdict on hand-made records: a request's end (refused, completed, failed,
retried after its gateway was killed) and each fault's recovery, counted per fault — a stream
that spans two faults is the second's once the second has started."""

from __future__ import annotations

import pytest

from bench.live.chaos import retry_delay_s
from bench.live.chaos_rig import Fault
from bench.live.chaos_verdict import Sent, classify, recovery, spread, stalled, tally
from bench.report.metrics import RequestRecord


def stream(chunks: list[float], start: float = 0.0, tokens: int | None = None, error: str | None = None) -> RequestRecord:
    """A record whose chunks arrived at `chunks` (seconds from the phase's start)."""
    n = len(chunks)
    gaps = [b - a for a, b in zip(chunks, chunks[1:])]
    return RequestRecord(error is None, ttft_s=chunks[0] - start if chunks else None, tbt_s=gaps,
                         output_tokens=n, expected_output_tokens=tokens or n, start_s=start, error=error)  # fmt: skip


def sent(record: RequestRecord, end: float, retries: int = 0, first: float | None = None) -> Sent:
    return Sent(record, retries, record.start_s if first is None else first, end)


def test_each_end_is_classified_and_a_retried_request_counts_as_accepted():
    cut = "ServerDisconnectedError: Server disconnected"
    assert classify(stream([1.0, 2.0])) == "completed"
    assert classify(stream([], error="HTTP 429: busy")) == "refused"
    assert classify(stream([], error="ClientConnectorError: refused")) == "refused"
    assert classify(stream([], error="ClientConnectorError: refused"), num_retries=3) == "failed"
    assert classify(stream([1.0], tokens=4, error=cut)) == "failed"
    assert classify(stream([5.0, 6.0]), num_retries=1) == "completed"


def test_recovery_is_per_fault_and_a_stream_spanning_two_faults_is_the_second_s():
    """Fault A (10-12 s) stalls streams x and y; y flows at 13 s, x only after fault B (20-22 s)
    started: A recovered in 1 s (first) but not all of its streams did before B; B stalled x
    (and z), which flow at 24 and 23 s."""
    a, b = Fault("kill", "worker", 10.0, 12.0), Fault("stop", "worker", 20.0, 22.0)
    x = sent(stream([1, 2, 9, 24, 25], start=0.5), end=25)
    y = sent(stream([3, 9.5, 13, 14], start=2.5), end=14)
    z = sent(stream([15, 19, 23], start=14.5), end=23)
    quiet = sent(stream([30, 31], start=29), end=31)  # after both
    records = [x, y, z, quiet]
    assert stalled(a, records, 2.0) == [x, y] and stalled(b, records, 2.0) == [x, z]
    ra = recovery(a, b.start_s, records, 2.0)
    assert ra == {"stalled": 2, "unrecovered": 1, "first_s": 1.0, "all_s": None}
    rb = recovery(b, 40.0, records, 2.0)
    assert rb == {"stalled": 2, "unrecovered": 0, "first_s": 1.0, "all_s": 2.0}
    assert recovery(Fault("raise_step", "worker", 26.0, 26.0), 40.0, records, 2.0)["first_s"] == 0.0  # none stalled


def test_a_failed_or_silent_stream_leaves_its_fault_unrecovered_never_dropped():
    f = Fault("kill", "scheduler", 10.0, 10.5)
    lost = sent(stream([5, 9], start=4, tokens=8, error="stream error: lost"), end=30)
    r = recovery(f, 60.0, [lost], 2.0)
    assert r == {"stalled": 1, "unrecovered": 1, "first_s": None, "all_s": None}
    assert spread([1.0, None, None]) == (None, None)  # the median is an unrecovered fault
    assert spread([1.0, 2.0, None]) == (2.0, None)
    assert spread([3.0, 1.0, 2.0]) == (2.0, 3.0)


def test_a_request_cut_with_its_gateway_is_stalled_from_its_first_sending():
    """Its first attempt's chunks are gone; the retry (started after the kill) completes: it
    counts as stalled by the kill, recovered at the retry's first chunk, completed after a retry."""
    kill = Fault("kill", "gateway0", 10.0, 10.0)
    retried = sent(stream([11.5, 12.0], start=10.6), end=12, retries=1, first=3.0)
    assert stalled(kill, [retried], 2.0) == [retried]
    assert recovery(kill, 50.0, [retried], 2.0)["first_s"] == pytest.approx(1.5)
    t = tally([None], [retried], ["ab"], ["ab"], [0], [kill], 2.0, 50.0)
    assert (t["accepted"], t["completed"], t["completed_after_client_retry"], t["identical"]) == (1, 1, 1, 1)


def test_retries_back_off_as_the_openai_client():
    import random

    rng = random.Random(0)
    delays = [retry_delay_s(n, rng) for n in range(6)]
    for n, d in enumerate(delays):
        full = min(0.5 * 2**n, 8.0)
        assert 0.75 * full <= d <= full, (n, d)


def test_a_request_sent_just_after_a_kill_and_held_through_it_is_stalled_by_it():
    """A kill lasts no time; a request that arrives before the server noticed it waits for the
    replacement worker: it is the kill's; one sent well after the kill is not."""
    kill = Fault("kill", "worker", 45.0, 45.0)
    held = sent(stream([52.0, 52.5], start=46.0), end=53)
    later = sent(stream([55.0, 55.5], start=50.0), end=56)
    assert stalled(kill, [held, later], 2.0) == [held]
    assert recovery(kill, 90.0, [held, later], 2.0)["first_s"] == 7.0

