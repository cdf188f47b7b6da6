"""`superinfer bench quant`'s ratio to the bandwidth limit, where the machine's memory read
switches between two speeds within a run: each step is held to the read of its own round."""

from __future__ import annotations

from bench.micro.quant import by_read_state


def test_rounds_split_by_the_read_they_saw():
    times = [0.004] * 6 + [0.003] * 6
    reads = [33.0, 34.0, 35.0, 33.5, 34.5, 33.0] + [60.0, 61.0, 59.0, 62.0, 60.5, 58.0]
    states = by_read_state(times, reads)
    assert list(states) == ["33-35 GB/s", "58-62 GB/s"]
    assert all(t == 0.004 for t, _ in states["33-35 GB/s"]) and all(t == 0.003 for t, _ in states["58-62 GB/s"])


def test_one_state_or_too_few_rounds_gives_no_split():
    assert by_read_state([0.004] * 10, [33.0, 35.0] * 5) == {}  # within 1.3x: one state
    assert by_read_state([0.004] * 10, [33.0] * 8 + [60.0] * 2) == {"33-33 GB/s": [(0.004, 33.0)] * 8}
