"""Cache-aware routing (services/gateway/routing.py) on the gateway's real client and two real
scheduler services (each with a toy worker, tests/reliability/rig.py), over ipc sockets: the
prefix-cache events the schedulers report, the gateway's copy of them, and where the next turn
of a conversation goes. The headroom rule and the session pin are checked on load reports fed
by hand (test_routing.py's `Peers`)."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from types import SimpleNamespace

import msgspec

from services.gateway.routing import LinkCache, prompt_keys
from services.gateway.scheduler_client import SchedulerClient
from services.scheduler.cache_report import CacheReport
from services.scheduler.core import SchedulerConfig
from services.scheduler.service import SchedulerService
from shared import protocol as p
from shared.log import setup_logging
from tests.reliability.rig import BLOCK_SIZE, ToyWorker, until
from tests.scaleout.test_routing import Peers, stats

_ids = itertools.count()


class Replica:
    """A scheduler service in this event loop and its toy worker."""

    def __init__(self, tmp_path, name: str) -> None:
        self.addr, self.worker_addr = f"ipc://{tmp_path}/{name}.sock", f"ipc://{tmp_path}/{name}-w.sock"
        cfg = SchedulerConfig(max_batched_tokens=64)
        self.service = SchedulerService(cfg, self.addr, self.worker_addr, setup_logging("scheduler", "warning"),
                                        admin_bind="off", step_timeout_s=2.0)
        self.task = asyncio.create_task(self.service.run())
        self.worker = ToyWorker(self.worker_addr)

    async def stop(self) -> None:
        await self.worker.kill()
        self.service.stopping = True
        await self.task


async def cluster(tmp_path, names=("a", "b")) -> tuple[list[Replica], SchedulerClient]:
    replicas = [Replica(tmp_path, n) for n in names]
    client = SchedulerClient([r.addr for r in replicas], gateway_id="gw-cache", routing="cache-aware")
    await client.start()
    assert await until(lambda: len(client.live_links()) == 2 and not any(l.cache.wants_snapshot for l in client.links))
    return replicas, client


async def complete(client: SchedulerClient, prompt: list[int], link=None, max_tokens: int = 6):
    """Route (unless `link` is given), run to the end; (the link it ran on, its output tokens)."""
    link = link or client.pick(prompt)
    handle = client.submit(p.AddRequest(f"r{next(_ids)}", prompt, p.SamplingParams(max_tokens=max_tokens)), link)
    out: list[int] = []
    while True:
        reply = await asyncio.wait_for(handle.get(), 10)
        assert isinstance(reply, p.TokenOutput), reply
        out += reply.token_ids
        if reply.finish_reason is not None:
            return handle.link, out


def held(link, tokens: list[int]) -> int:
    """Blocks of `tokens`' head that the gateway believes `link` holds."""
    return link.cache.match(prompt_keys(tokens, BLOCK_SIZE, link.stats.model_name))[0]


def no_advantage(link, tokens: list[int]) -> bool:
    """`link`'s predicted TTFT for `tokens` is that of a prompt it holds nothing of."""
    keys = prompt_keys(tokens, BLOCK_SIZE, link.stats.model_name)
    return link.predict(len(tokens), keys) == link.predict(len(tokens), [])


def conversation(seed: int, num_tokens: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 900) for _ in range(num_tokens)]


def run(coro):
    asyncio.run(asyncio.wait_for(coro, 60))


async def shut(replicas, client) -> None:
    await client.close()
    for r in replicas:
        await r.stop()


def test_second_turns_go_where_their_first_turn_left_its_prefix(tmp_path):
    async def go():
        replicas, client = await cluster(tmp_path)
        try:
            firsts = []
            for c in range(4):
                prompt = conversation(c)
                link, out = await complete(client, prompt)
                firsts.append(link)
                history = prompt + out
                # The scheduler's own events tell the gateway; the gateway names the blocks alike.
                assert await until(lambda: held(link, history) >= len(prompt) // BLOCK_SIZE)
                before = link.num_routed_cached_tokens
                second, _ = await complete(client, history + conversation(100 + c, 8))
                assert second is link
                assert link.num_routed_cached_tokens - before >= len(prompt) // BLOCK_SIZE * BLOCK_SIZE
            assert set(firsts) == set(client.links)  # the first turns tie and take turns
        finally:
            await shut(replicas, client)

    run(go())


def test_a_replica_that_dropped_the_prefix_is_no_longer_preferred(tmp_path):
    async def go():
        replicas, client = await cluster(tmp_path)
        try:
            prompt = conversation(7)
            link, out = await complete(client, prompt)
            history = prompt + out
            assert await until(lambda: held(link, history) > 0)
            assert all(client.pick(history) is link for _ in range(3)) and not no_advantage(link, history)
            # Other prompts fill its 64-block HBM pool: the cached prefix is evicted there.
            for k in range(4):
                await complete(client, conversation(50 + k, 180), link=link, max_tokens=1)
            assert await until(lambda: held(link, history) == 0)
            assert no_advantage(link, history)
        finally:
            await shut(replicas, client)

    run(go())


def test_the_index_forgets_a_restarted_scheduler(tmp_path):
    async def go():
        replicas, client = await cluster(tmp_path)
        try:
            prompt = conversation(9)
            link, out = await complete(client, prompt)
            history = prompt + out
            assert await until(lambda: held(link, history) > 0)
            i = client.links.index(link)
            old_id = link.stats.scheduler_id
            await replicas[i].stop()
            replicas[i] = Replica(tmp_path, "ab"[i])  # a new instance at the same address
            assert await until(lambda: link.stats is not None and link.stats.scheduler_id != old_id
                               and link.routable(time.monotonic()) and not link.cache.wants_snapshot)
            assert held(link, history) == 0 and not link.cache.hbm
            assert no_advantage(link, history)
        finally:
            await shut(replicas, client)

    run(go())


def test_a_replica_short_of_headroom_is_avoided_even_holding_the_prefix(tmp_path):
    peers = Peers(tmp_path, 0, num_absent=2, routing="cache-aware")
    try:
        prompt = conversation(3, 160)
        keys = prompt_keys(prompt, 16, "m")
        holder, other = peers.client.links
        snap = p.CacheEvents(hbm_added=keys, snapshot=True)
        peers.client.on_frame(holder, p.encode(msgspec.structs.replace(stats(512, 400, num_running=4), cache=snap)))
        peers.report(1, stats(512, 400, num_running=4))
        assert all(peers.client.pick(prompt) is holder for _ in range(3))
        # A session pinned elsewhere comes back to the holder only while the holder has headroom.
        assert peers.client.pick(conversation(4), session="s1") is not None
        peers.client.router.sessions.pin("s1", other.addr)
        assert peers.client.pick(prompt, session="s1") is other  # the pin is a hint the score leaves alone
        peers.client.on_frame(holder, p.encode(stats(512, 400, num_running=4, num_waiting=1)))  # left one out
        assert holder.cache.match(keys)[0] == len(keys)  # it still holds the prefix
        assert all(peers.client.pick(prompt) is other for _ in range(3))
        peers.client.router.sessions.pin("s2", holder.addr)
        assert peers.client.pick(prompt, session="s2") is other
        assert peers.client.router.sessions.get("s2") == other.addr
    finally:
        peers.close()


def test_reports_out_of_sequence_drop_the_copy_until_a_snapshot():
    report, cache = CacheReport(max_events=3), LinkCache()
    core = SimpleNamespace(memory=SimpleNamespace(hbm=SimpleNamespace(index={}), dram=SimpleNamespace(index={})))
    index = core.memory.hbm.index
    for i in range(5):
        index[bytes([i]) * 16] = i

    def told(ev) -> None:  # a report as it reaches the gateway: its seq and its events
        cache.on_report(report.seq, ev)

    told(report.snapshot())
    ev = report.core_events(core)
    assert len(ev.hbm_added) == 3  # bounded: the rest comes with the next report
    told(ev)
    index = core.memory.hbm.index  # the pool's index, now noting its changes
    index[b"x" * 16] = 9
    del index[b"x" * 16]  # came and went between two reports: never told
    told(report.core_events(core))
    assert len(cache.hbm) == 5 and cache.seq == 2
    assert report.core_events(core) is None
    told(None)  # a report with no events (a hello's answer) changes nothing
    assert len(cache.hbm) == 5
    del index[bytes([0]) * 16]
    report.core_events(core)  # a report this gateway never got
    del index[bytes([1]) * 16]
    told(report.core_events(core))
    assert cache.wants_snapshot and not cache.hbm
    told(report.snapshot())
    assert not cache.wants_snapshot and len(cache.hbm) == 3
    told(report.core_events(None))  # the worker is gone: its blocks with it
    told(report.core_events(None))
    assert not cache.hbm and not cache.wants_snapshot and report.core_events(None) is None


def test_the_operator_sees_each_replicas_cache_hit_share():
    from services import admin_cli

    st = msgspec.structs.replace(stats(64), num_prefix_queries=1000, num_prefix_hits=600, num_tier_hits=150)
    assert "75.0% of 1000 prompt tokens routed here were cached (hbm 600, dram tier 150)" in admin_cli.prefix_line(st)
    assert "n/a of 0" in admin_cli.prefix_line(stats(64))


def test_a_replica_without_a_step_time_fit_is_not_taken_for_a_slower_one(tmp_path):
    """New conversations spread over idle replicas whether or not each has fitted its step time."""
    peers = Peers(tmp_path, 0, num_absent=2, routing="cache-aware")
    try:
        peers.client.on_frame(peers.client.links[0], p.encode(msgspec.structs.replace(
            stats(512), prefill_s_per_token=1e-4, step_s=0.02)))
        peers.report(1, stats(512))
        picks = [peers.client.pick(conversation(k, 300)) for k in range(4)]
        assert set(picks) == set(peers.client.links), picks
    finally:
        peers.close()
