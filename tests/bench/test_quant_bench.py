"""`superinfer bench quant`'s ratio to the bandwidth limit, where the machine's memory read
switches between two speeds within a run and the host moves the two cores between sharing a
cache and not: each step is held to the read of its own round, and each state given apart."""

from __future__ import annotations

from bench.micro.quant import by_state

NEAR, APART = [40.0] * 12, [170.0] * 12


def test_rounds_split_by_the_read_they_saw():
    times = [0.004] * 6 + [0.003] * 6
    reads = [33.0, 34.0, 35.0, 33.5, 34.5, 33.0] + [60.0, 61.0, 59.0, 62.0, 60.5, 58.0]
    states = by_state(times, reads, APART)
    assert list(states) == ["cores apart, 33-35 GB/s", "cores apart, 58-62 GB/s"]
    assert all(t == 0.004 for t, _ in states["cores apart, 33-35 GB/s"])
    assert all(t == 0.003 for t, _ in states["cores apart, 58-62 GB/s"])


def test_rounds_split_by_where_the_cores_were():
    times = [0.004] * 6 + [0.003] * 6
    reads = [33.0, 34.0, 35.0, 33.5, 34.5, 33.0] * 2  # one read speed, two placements
    states = by_state(times, reads, [40.0] * 6 + [170.0] * 6)
    assert list(states) == ["cores sharing a cache, 33-35 GB/s", "cores apart, 33-35 GB/s"]
    assert all(t == 0.003 for t, _ in states["cores apart, 33-35 GB/s"])


def test_one_state_or_too_few_rounds_gives_no_split():
    assert by_state([0.004] * 10, [33.0, 35.0] * 5, NEAR) == {}  # within 1.3x, one placement: one state
    assert by_state([0.004] * 10, [33.0] * 8 + [60.0] * 2, NEAR) == {
        "cores sharing a cache, 33-33 GB/s": [(0.004, 33.0)] * 8
    }
