"""The gateway's ZeroMQ side against a bare ROUTER socket playing the scheduler's part.

The real scheduler never sends a malformed frame or falls silent on purpose, so these
paths are driven here by hand: hello and heartbeat, routing replies to requests, surviving
garbage, aborting, and failover: the requests of a scheduler that closed, restarted or
went quiet are resubmitted (prompt plus streamed tokens) to the next one that reports in,
or fail once the grace period is over.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import zmq
import zmq.asyncio

from services.gateway import scheduler_client
from services.gateway.errors import ApiError
from services.gateway.scheduler_client import SchedulerClient
from shared.protocol import (
    AbortRequest,
    AddRequest,
    GatewayHello,
    RequestError,
    SamplingParams,
    SchedulerStats,
    StepOutputs,
    TokenOutput,
    encode,
    gateway_msg_decoder,
)

STATS = SchedulerStats(
    scheduler_id="s0", model_name="m", max_model_len=64, num_waiting=0, num_running=0, num_rotary=0,
    num_hbm_blocks=10, num_free_hbm_blocks=10, num_dram_blocks=0, num_free_dram_blocks=0,
)


class Peer:
    """A ROUTER bound where a scheduler would be."""

    def __init__(self, addr: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(addr)
        self.gateway: bytes | None = None

    async def recv(self):
        ident, frame = await asyncio.wait_for(self.sock.recv_multipart(), 5)
        self.gateway = ident
        return gateway_msg_decoder.decode(frame)

    async def recv_until(self, kind):
        while not isinstance(msg := await self.recv(), kind):
            pass
        return msg

    async def send(self, payload) -> None:
        await self.sock.send_multipart([self.gateway, payload if isinstance(payload, bytes) else encode(payload)])

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def add(rid: str) -> AddRequest:
    return AddRequest(request_id=rid, prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=3))


async def connected(addr: str, **kwargs) -> tuple[Peer, SchedulerClient]:
    peer, client = Peer(addr), SchedulerClient([addr], gateway_id="gw-test", **kwargs)
    await client.start()
    await introduce(peer, client)
    return peer, client


async def introduce(peer: Peer, client: SchedulerClient, stats: SchedulerStats = STATS) -> None:
    """The peer answers the gateway's hello with a load report; the link becomes routable."""
    hello = await peer.recv_until(GatewayHello)
    assert hello.gateway_id == "gw-test" and peer.gateway == b"gw-test"
    await peer.send(stats)
    for _ in range(100):
        if client.live_links():
            break
        await asyncio.sleep(0.01)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_replies_reach_their_request_and_bad_frames_are_skipped(tmp_path):
    async def go():
        peer, client = await connected(f"ipc://{tmp_path}/s.sock")
        try:
            link = client.pick()
            h1, h2 = client.submit(add("r1"), link), client.submit(add("r2"), link)
            assert {(await peer.recv_until(AddRequest)).request_id for _ in range(2)} == {"r1", "r2"}
            await peer.send(b"\x93not a message")
            await peer.send(b"")
            outputs = [TokenOutput("r2", [7]), TokenOutput("r1", [5]), TokenOutput("zz", [1])]  # zz: unknown id
            await peer.send(StepOutputs(outputs=outputs))
            await peer.send(StepOutputs(outputs=[TokenOutput("r1", [6], "length")]))
            await peer.send(RequestError(request_id="r2", message="busy", type="overloaded"))
            assert [await h1.get(), await h1.get()] == [TokenOutput("r1", [5]), TokenOutput("r1", [6], "length")]
            assert await h2.get() == TokenOutput("r2", [7])
            assert isinstance(await h2.get(), RequestError)
            assert link.request_ids == set()  # both finished: nothing tracked
        finally:
            await client.close()
            peer.close()

    run(go())


def test_abort_reaches_the_scheduler_and_later_outputs_are_dropped(tmp_path):
    async def go():
        peer, client = await connected(f"ipc://{tmp_path}/s.sock")
        try:
            h = client.submit(add("r1"), client.pick())
            await peer.recv_until(AddRequest)
            client.abort("r1")
            assert (await peer.recv_until(AbortRequest)).request_id == "r1"
            await peer.send(StepOutputs(outputs=[TokenOutput("r1", [9], "abort")]))
            await asyncio.sleep(0.1)
            assert h.queue.empty()
        finally:
            await client.close()
            peer.close()

    run(go())


def test_close_aborts_requests_still_running(tmp_path):
    async def go():
        peer, client = await connected(f"ipc://{tmp_path}/s.sock")
        client.submit(add("r1"), client.pick())
        await peer.recv_until(AddRequest)
        await client.close()
        assert (await peer.recv_until(AbortRequest)).request_id == "r1"
        peer.close()

    run(go())


def test_silent_scheduler_fails_its_requests_after_the_grace_period(tmp_path, monkeypatch):
    monkeypatch.setattr(scheduler_client, "STALE_AFTER_S", 0.5)

    async def go():
        peer, client = await connected(f"ipc://{tmp_path}/s.sock", failover_grace_s=0.5)
        try:
            h = client.submit(add("r1"), client.pick())
            err = await asyncio.wait_for(h.get(), 5)  # the peer never answers
            assert isinstance(err, RequestError) and err.type == "service_unavailable"
            assert "within 0.5s" in err.message
            assert client.live_links() == []
            with pytest.raises(ApiError) as e:
                client.pick()
            assert e.value.status == 503 and e.value.headers()["Retry-After"]
        finally:
            await client.close()
            peer.close()

    run(go())


def test_restarted_scheduler_gets_the_request_back_with_its_streamed_tokens(tmp_path):
    """The scheduler process dies mid-stream and a new one binds the same address: the
    request goes to it as prompt + the tokens already streamed, under a new wire id, and
    the client's handle simply carries on."""
    addr = f"ipc://{tmp_path}/s.sock"

    async def go():
        peer, client = await connected(addr)
        try:
            h = client.submit(add("r1"), client.pick())
            await peer.recv_until(AddRequest)
            await peer.send(StepOutputs(outputs=[TokenOutput("r1", [5])]))
            assert await h.get() == TokenOutput("r1", [5])
            peer.close()  # the connection closes: the monitor reports it at once
            with pytest.raises(ApiError):  # new requests: 503 while no scheduler is there
                for _ in range(50):
                    client.pick()
                    await asyncio.sleep(0.02)
            peer = Peer(addr)
            await introduce(peer, client, msgspec.structs.replace(STATS, scheduler_id="s1"))
            again = await peer.recv_until(AddRequest)
            assert again.request_id == "r1~1" and again.prompt_token_ids == [1, 2]
            assert again.output_token_ids == [5] and again.params.max_tokens == 3
            await peer.send(StepOutputs(outputs=[TokenOutput("r1", [7]), TokenOutput("r1~1", [6])]))
            await peer.send(StepOutputs(outputs=[TokenOutput("r1~1", [8], "length")]))
            assert [await h.get(), await h.get()] == [TokenOutput("r1", [6]), TokenOutput("r1", [8], "length")]
            assert h.queue.empty()  # the old wire id's late output was dropped
        finally:
            await client.close()
            peer.close()

    run(go())


def test_scheduler_back_from_silence_aborts_the_lost_attempt_first(tmp_path, monkeypatch):
    """A scheduler that went quiet and answers again still runs the old attempt: it is told
    to abort that before it gets the resubmission; a refusal for now is retried."""
    monkeypatch.setattr(scheduler_client, "STALE_AFTER_S", 0.5)

    async def go():
        peer, client = await connected(f"ipc://{tmp_path}/s.sock")
        try:
            h = client.submit(add("r1"), client.pick())
            await peer.recv_until(AddRequest)
            await asyncio.sleep(0.8)  # silent past STALE_AFTER_S: lost
            assert client.live_links() == []
            await peer.send(STATS)
            assert (await peer.recv_until(AbortRequest)).request_id == "r1"
            assert (await peer.recv_until(AddRequest)).request_id == "r1~1"
            await peer.send(RequestError("r1~1", "busy", "overloaded"))
            assert (await peer.recv_until(AddRequest)).request_id == "r1~2"
            await peer.send(StepOutputs(outputs=[TokenOutput("r1~2", [4], "stop")]))
            assert await h.get() == TokenOutput("r1", [4], "stop")
        finally:
            await client.close()
            peer.close()

    run(go())


def test_a_lost_final_output_ends_the_request_at_max_tokens(tmp_path):
    async def go():
        peer, client = await connected(f"ipc://{tmp_path}/s.sock")
        try:
            h = client.submit(add("r1"), client.pick())
            await peer.recv_until(AddRequest)
            await peer.send(StepOutputs(outputs=[TokenOutput("r1", [5, 6, 7])]))  # all 3 tokens
            assert await h.get() == TokenOutput("r1", [5, 6, 7])
            peer.close()
            assert await asyncio.wait_for(h.get(), 5) == TokenOutput("r1", [], "length")
        finally:
            await client.close()
            peer.close()

    run(go())


def test_no_scheduler_means_503(tmp_path):
    async def go():
        client = SchedulerClient([f"ipc://{tmp_path}/nobody.sock"])
        await client.start()
        try:
            with pytest.raises(ApiError) as e:
                client.pick()
            assert e.value.status == 503
        finally:
            await client.close()

    run(go())


@settings(max_examples=300, deadline=None)
@given(frame=st.binary(max_size=64) | st.builds(lambda b, n: b[:n], st.just(encode(STATS)), st.integers(0, 40)))
def test_any_frame_is_survived(frame):
    """Random bytes and truncated real messages are dropped without raising."""
    client = SchedulerClient(["ipc:///nonexistent/superinfer-test.sock"])
    try:
        client.on_frame(client.links[0], frame)
    finally:
        client.close_sockets()
