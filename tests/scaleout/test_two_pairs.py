"""Two scheduler/worker pairs behind one gateway, each service its own process on loopback
tcp://. Load reaches both pairs, less of it the one with the small HBM pool; when one pair
is killed (SIGKILL, both processes) its requests in flight are resubmitted to the other and
end with the same greedy text, and new requests are served by the other at once."""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench.live.server import STARTUP_TIMEOUT_S
from tests.scaleout.cluster import health, post_json, start_gateway, start_pair, wait_until

BIG_HBM_BLOCKS = 256
SMALL_HBM_BLOCKS = 12  # ~4 requests of ~40 tokens (3 blocks of 16 each)
NUM_REQUESTS = 24
CONCURRENCY = 6
MAX_TOKENS = 8
FAILOVER_S = 5.0  # the first request after the kill is served within this
LONG_TOKENS = 48  # in flight long enough to be cut by the kill


def completion(base_url: str, n: int, max_tokens: int = MAX_TOKENS) -> tuple[int, dict]:
    body = {
        "prompt": f"Request {n}: list three facts about the number {n}, one per line, in plain words.",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return post_json(base_url + "/v1/completions", body)


def routed(gateway) -> Counter:
    return Counter(e["scheduler"] for e in gateway.log_events("request_routed"))


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_load_skews_away_from_the_small_pool_and_survives_a_killed_pair(tmp_path):
    worker_args = ("--dram-gb", "0.25")
    big = start_pair(tmp_path, "big", "--hbm-blocks", str(BIG_HBM_BLOCKS), *worker_args)
    small = start_pair(tmp_path, "small", "--hbm-blocks", str(SMALL_HBM_BLOCKS), *worker_args)
    # Headroom routing: the skew by pool size is its rule (cache-aware weighs predicted TTFT).
    gateway, base_url = start_gateway(tmp_path, [big.addr, small.addr], "--routing", "headroom")
    procs = [big.scheduler, big.worker, small.scheduler, small.worker, gateway]
    try:
        both_ready = lambda: len(health(base_url).get("schedulers", [])) == 2  # noqa: E731
        assert wait_until(both_ready, STARTUP_TIMEOUT_S, procs), health(base_url)

        with ThreadPoolExecutor(CONCURRENCY) as pool:
            results = list(pool.map(lambda n: completion(base_url, n), range(NUM_REQUESTS)))
        assert [status for status, _ in results] == [200] * NUM_REQUESTS, results
        assert all(body["usage"]["completion_tokens"] == MAX_TOKENS for _, body in results)

        counts = routed(gateway)
        assert sum(counts.values()) == NUM_REQUESTS
        assert 0 < counts[small.addr] < counts[big.addr], counts
        skew = f"big {counts[big.addr]}, small {counts[small.addr]}"
        # The pairs' own step traces agree: both computed tokens, the small one fewer.
        assert 0 < small.num_tokens() < big.num_tokens(), (small.num_tokens(), big.num_tokens())

        # Requests in flight on both pairs when the big one dies; a new one right after.
        long_ids = range(200, 200 + CONCURRENCY)
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            running = [pool.submit(completion, base_url, n, LONG_TOKENS) for n in long_ids]
            tokens_before = big.num_tokens()
            assert wait_until(lambda: big.num_tokens() > tokens_before + 2 * CONCURRENCY, 60, procs)
            big.kill()
            killed_at = time.monotonic()
            status, body = completion(base_url, 100)
            first_served_s = time.monotonic() - killed_at
            cut = [f.result() for f in running]
        assert status == 200, body
        assert first_served_s < FAILOVER_S, first_served_s
        assert [status for status, _ in cut] == [200] * CONCURRENCY, cut
        resubmitted = gateway.log_events("request_resubmitted")
        assert resubmitted, "no request was in flight on the big pair"
        # The same requests served by the small pair alone: the same greedy text.
        alone = [completion(base_url, n, LONG_TOKENS) for n in long_ids]
        assert [b["choices"][0]["text"] for _, b in cut] == [b["choices"][0]["text"] for _, b in alone]
        assert set(routed(gateway) - counts) == {small.addr, big.addr}  # big: before the kill only
        counts = routed(gateway)
        later = [completion(base_url, 101 + n) for n in range(3)]
        assert [s for s, _ in later] == [200] * 3, later
        assert routed(gateway) - counts == Counter({small.addr: 3})
        # The dead scheduler has left /health (heartbeat timeout at the latest).
        assert wait_until(lambda: len(health(base_url).get("schedulers", [])) == 1, 10), health(base_url)
        print(f"routed {skew} of {NUM_REQUESTS}; after the kill the first request was served in {first_served_s:.2f}s")
    finally:
        gateway.stop()
        small.stop()
        big.kill()
        for proc in procs:
            proc.kill()
