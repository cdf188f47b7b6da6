"""Failover while a worker restarts, the gateway against bare ROUTER sockets playing schedulers:
a lost request goes to a scheduler that is there but still getting its worker back (it holds
it) instead of failing when the failover grace runs out; a request a scheduler aborted because
it took this gateway for gone comes back; held requests move to a scheduler whose worker is
ready as soon as there is one; a refusal's reason survives into the final error."""

from __future__ import annotations

import asyncio

import msgspec

from services.gateway.scheduler_client import SchedulerClient
from shared.protocol import (
    GATEWAY_SILENT,
    AbortRequest,
    AddRequest,
    GatewayHello,
    RequestError,
    StepOutputs,
    TokenOutput,
)
from tests.gateway.test_scheduler_client import STATS, Peer, add, introduce, run

NOT_READY = msgspec.structs.replace(STATS, scheduler_id="s1", worker_ready=False)


async def client_for(*addrs: str, grace_s: float) -> SchedulerClient:
    client = SchedulerClient(list(addrs), gateway_id="gw-test", failover_grace_s=grace_s)
    await client.start()
    return client


def test_a_restarted_scheduler_without_its_worker_yet_holds_the_request_past_the_grace(tmp_path):
    """The scheduler restarts; its worker takes longer than the grace period to come back.
    The request is resubmitted to the new scheduler at once (it holds it: `resumed`, so its
    waiting bound does not refuse it) and completes when the worker is ready."""
    addr = f"ipc://{tmp_path}/s.sock"

    async def go():
        peer = Peer(addr)
        client = await client_for(addr, grace_s=3.0)
        await introduce(peer, client)
        try:
            h = client.submit(add("r1"), client.pick())
            await peer.recv_until(AddRequest)
            await peer.send(StepOutputs(outputs=[TokenOutput("r1", [5])]))
            assert await h.get() == TokenOutput("r1", [5])
            peer.close()
            peer = Peer(addr)
            await introduce(peer, client, NOT_READY)
            again = await peer.recv_until(AddRequest)
            assert again.request_id == "r1~1" and again.resumed and again.output_token_ids == [5]
            for _ in range(4):  # the worker loads, longer than the grace period; reports go on
                await asyncio.sleep(1.0)
                await peer.send(NOT_READY)
            assert h.queue.empty(), "failed while its scheduler held it"
            await peer.send(msgspec.structs.replace(NOT_READY, worker_ready=True))
            await peer.send(StepOutputs(outputs=[TokenOutput("r1~1", [6, 7], "length")]))
            assert await asyncio.wait_for(h.get(), 5) == TokenOutput("r1", [6, 7], "length")
        finally:
            await client.close()
            peer.close()

    run(go())


def test_a_request_aborted_as_of_a_silent_gateway_is_resubmitted_not_failed(tmp_path):
    addr = f"ipc://{tmp_path}/s.sock"

    async def go():
        peer = Peer(addr)
        client = await client_for(addr, grace_s=5.0)
        await introduce(peer, client)
        try:
            h = client.submit(add("r1"), client.pick())
            await peer.recv_until(AddRequest)
            await peer.send(StepOutputs(outputs=[TokenOutput("r1", [5])]))
            await peer.send(RequestError("r1", "aborted by the scheduler: its gateway was silent", GATEWAY_SILENT))
            again = await peer.recv_until(AddRequest)
            assert again.request_id == "r1~1" and again.resumed and again.output_token_ids == [5]
            await peer.send(StepOutputs(outputs=[TokenOutput("r1~1", [6, 7], "length")]))
            assert await h.get() == TokenOutput("r1", [5])
            assert await asyncio.wait_for(h.get(), 5) == TokenOutput("r1", [6, 7], "length")
        finally:
            await client.close()
            peer.close()

    run(go())


def test_held_requests_move_to_a_scheduler_whose_worker_is_ready(tmp_path):
    """Scheduler A lost its worker and holds the request; B reports a ready worker: A is
    told to abort it and B gets it."""
    addr_a, addr_b = f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/b.sock"

    async def go():
        a = Peer(addr_a)
        client = await client_for(addr_a, addr_b, grace_s=5.0)
        await introduce(a, client)
        b = Peer(addr_b)
        try:
            h = client.submit(add("r1"), client.pick())
            assert (await a.recv_until(AddRequest)).request_id == "r1"
            await a.send(msgspec.structs.replace(STATS, worker_ready=False))  # A's worker is lost: it holds r1
            await asyncio.sleep(0.3)
            await b.recv_until(GatewayHello)
            await b.send(msgspec.structs.replace(STATS, scheduler_id="s2"))
            assert (await a.recv_until(AbortRequest)).request_id == "r1"
            moved = await b.recv_until(AddRequest)
            assert moved.request_id == "r1~1" and moved.resumed
            await b.send(StepOutputs(outputs=[TokenOutput("r1~1", [4, 5, 6], "length")]))
            assert await asyncio.wait_for(h.get(), 5) == TokenOutput("r1", [4, 5, 6], "length")
        finally:
            await client.close()
            a.close()
            b.close()

    run(go())


def test_past_the_grace_the_error_says_why_the_last_try_was_refused(tmp_path):
    """A scheduler that held the request in vain (no worker within its wait) refuses it; no
    other takes it: the client's error carries that refusal, not just 'lost'."""
    addr = f"ipc://{tmp_path}/s.sock"

    async def go():
        peer = Peer(addr)
        client = await client_for(addr, grace_s=3.0)
        await introduce(peer, client)
        try:
            h = client.submit(add("r1"), client.pick())
            await peer.recv_until(AddRequest)
            peer.close()
            peer = Peer(addr)
            await introduce(peer, client, NOT_READY)
            again = await peer.recv_until(AddRequest)
            why = "no model worker was ready within 120s (the last one was lost: step 7 not back after 3.0s)"
            await peer.send(RequestError(again.request_id, why, "service_unavailable"))  # not held twice
            err = await asyncio.wait_for(h.get(), 5)
            assert isinstance(err, RequestError) and err.type == "service_unavailable", err
            assert why in err.message and "none took it back" in err.message, err.message
        finally:
            await client.close()
            peer.close()

    run(go())
