"""The gateway's side of the gateway <-> scheduler sockets, and routing between schedulers.

One DEALER per scheduler address (its routing id is the gateway id, so a reconnect keeps
the same identity). A single receive task polls them all, drains at most
`MAX_RECV_PER_TICK` frames per socket per tick, and routes each reply to its request's
queue; a heartbeat task says hello every second and fails the requests of a scheduler that
has gone quiet, so no client waits forever on a dead peer.

Routing: `pick()` sends each new request to the live scheduler with the lowest
`headroom_score` (the formula is documented there, once), ties taken round-robin. A
scheduler leaves the rotation when it has not been heard from for `STALE_AFTER_S` (its load
reports double as heartbeats) or when a send to it fails (its connection is gone), and comes
back with its next message.

    pick() -> SchedulerLink                   submit(AddRequest, link) -> RequestHandle
    handle.get() -> TokenOutput | RequestError
    abort(request_id)                         live_stats() -> [SchedulerStats]
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid

import msgspec
import structlog
import zmq
import zmq.asyncio

from services.gateway.errors import unavailable
from shared.config import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_SEQS, ZMQ_HWM, ZMQ_LINGER_MS
from shared.protocol import (
    AbortRequest,
    AddRequest,
    GatewayHello,
    RequestError,
    SchedulerStats,
    StepOutputs,
    TokenOutput,
    encode,
    gateway_reply_decoder,
)

HEARTBEAT_S = 1.0
RETRY_HELLO_S = 0.1  # until a hello gets through (the connection is still being made)
STALE_AFTER_S = 5.0  # no message for this long: the scheduler is considered gone
MAX_RECV_PER_TICK = 256
# Load reports carry neither the scheduler's batch limit nor its block size: the defaults
# stand in for both when the score weighs running requests and sizes unreported ones.
BATCH_SLOTS = DEFAULT_MAX_NUM_SEQS
BLOCK_SIZE = DEFAULT_BLOCK_SIZE
TIE_EPS = 1e-9  # scores closer than this are a tie

log = structlog.get_logger()
Reply = TokenOutput | RequestError


class RequestHandle:
    """One submitted request's replies, in order; the last is final."""

    def __init__(self, request_id: str, link: SchedulerLink) -> None:
        self.request_id = request_id
        self.link = link
        self.queue: asyncio.Queue[Reply] = asyncio.Queue()  # bounded by max_tokens

    async def get(self) -> Reply:
        return await self.queue.get()


DRAINING_SCORE = 1e9


def headroom_score(stats: SchedulerStats, num_unreported: int = 0, num_unreported_blocks: int = 0) -> float:
    """How close a scheduler is to missing its SLOs; lower means more headroom.

        score = queued + batch + memory
        queued = num_waiting + num_rotary                       requests that cannot run now
        batch  = (num_running + num_unreported) / BATCH_SLOTS   share of the step's batch
        memory = (used HBM blocks + num_unreported_blocks) / num_hbm_blocks

    A queued request means the scheduler has no room this step (it waits behind the token
    budget, the batch limit or HBM), so each one weighs as much as a full HBM pool: a new
    request goes where nothing waits first. Among schedulers with nothing queued, the
    running batch (step time, hence TBT) and HBM use (how soon rotation starts) decide, so a
    smaller pool fills sooner and gets less. Requests this gateway sent since the last report
    ("unreported") count as running with their prompt's blocks, so a burst between two
    reports spreads out instead of piling onto one scheduler. Idle schedulers tie. A draining
    scheduler is picked only when every other one is gone (it then answers 503 itself)."""
    if stats.draining:
        return DRAINING_SCORE
    queued = stats.num_waiting + stats.num_rotary
    batch = (stats.num_running + num_unreported) / BATCH_SLOTS
    used = stats.num_hbm_blocks - stats.num_free_hbm_blocks + num_unreported_blocks
    return queued + batch + used / max(1, stats.num_hbm_blocks)


def num_blocks(req: AddRequest) -> int:
    """KV blocks a request needs at admission (its known tokens plus the next one)."""
    return math.ceil((len(req.prompt_token_ids) + len(req.output_token_ids) + 1) / BLOCK_SIZE)


class SchedulerLink:
    """One scheduler: its socket, its latest load report, and the requests it serves."""

    def __init__(self, addr: str, socket: zmq.asyncio.Socket) -> None:
        self.addr = addr
        self.socket = socket
        self.stats: SchedulerStats | None = None
        self.last_seen = float("-inf")
        self.request_ids: set[str] = set()
        self.next_hello = 0.0
        self.unreachable = False  # a send failed: out of rotation until it is heard from again
        # Requests sent since the last load report, which does not count them yet.
        self.num_unreported = 0
        self.num_unreported_blocks = 0

    def is_live(self, now: float) -> bool:
        return self.stats is not None and not self.unreachable and now - self.last_seen < STALE_AFTER_S

    def routable(self, now: float) -> bool:
        return self.is_live(now) and self.stats.worker_ready

    def score(self) -> float:
        return headroom_score(self.stats, self.num_unreported, self.num_unreported_blocks)

    def on_sent(self, req: AddRequest) -> None:
        self.request_ids.add(req.request_id)
        self.num_unreported += 1
        self.num_unreported_blocks += num_blocks(req)

    def on_report(self, stats: SchedulerStats, now: float) -> None:
        self.stats = stats
        self.num_unreported = self.num_unreported_blocks = 0
        self.on_heard(now)

    def on_heard(self, now: float) -> None:
        self.last_seen = now
        self.unreachable = False


def send_now(socket: zmq.asyncio.Socket, data: bytes) -> bool:
    """Send without waiting; False when the peer is not connected or its queue is full.
    (A non-blocking send on an asyncio socket resolves its future at once.)"""
    exc = socket.send(data, flags=zmq.NOBLOCK).exception()
    if exc is not None and not isinstance(exc, zmq.Again):
        raise exc
    return exc is None


def is_final(reply: Reply) -> bool:
    return isinstance(reply, RequestError) or reply.finish_reason is not None


class SchedulerClient:
    def __init__(self, addrs: list[str], gateway_id: str | None = None) -> None:
        if not addrs:
            raise ValueError("at least one scheduler address is needed")
        self.gateway_id = gateway_id or f"gw-{uuid.uuid4().hex[:12]}"
        self._ctx = zmq.asyncio.Context()
        self.links = [SchedulerLink(a, self._socket(a)) for a in addrs]
        self._by_socket = {link.socket: link for link in self.links}
        self._pending: dict[str, RequestHandle] = {}
        self._tasks: list[asyncio.Task] = []
        self._next = 0  # round-robin start: where the scan for the best link begins

    def _socket(self, addr: str) -> zmq.asyncio.Socket:
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.ROUTING_ID, self.gateway_id.encode())
        s.setsockopt(zmq.SNDHWM, ZMQ_HWM)
        s.setsockopt(zmq.RCVHWM, ZMQ_HWM)
        s.setsockopt(zmq.LINGER, ZMQ_LINGER_MS)
        s.setsockopt(zmq.IMMEDIATE, 1)  # queue only on live connections: a send to a gone peer fails fast
        s.connect(addr)
        return s

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._heartbeat_loop())]

    async def close(self) -> None:
        """Abort what is still running (no orphans left in the schedulers), then close."""
        for rid in list(self._pending):
            self.abort(rid)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for link in self.links:
            link.socket.close(linger=ZMQ_LINGER_MS)
        self._ctx.term()

    # ------------------------------------------------------------ requests

    def live_links(self) -> list[SchedulerLink]:
        now = time.monotonic()
        return [link for link in self.links if link.routable(now)]

    def live_stats(self) -> list[SchedulerStats]:
        return [link.stats for link in self.live_links()]

    def pick(self) -> SchedulerLink:
        """The live scheduler with the most SLO headroom (lowest `headroom_score`); among
        equal scores, the next in round-robin order. 503 when none is reachable.
        One pass over the links, no allocation: it runs for every request."""
        now = time.monotonic()
        num_links = len(self.links)
        best, best_index, best_score = None, 0, math.inf
        for k in range(num_links):
            i = (self._next + k) % num_links
            link = self.links[i]
            if link.routable(now) and (score := link.score()) < best_score - TIE_EPS:
                best, best_index, best_score = link, i, score
        if best is None:
            raise unavailable("no scheduler is reachable; retry shortly")
        self._next = (best_index + 1) % num_links
        return best

    def submit(self, req: AddRequest, link: SchedulerLink) -> RequestHandle:
        """Send to `link`; if its connection is gone, it leaves the rotation and the next
        best scheduler gets the request (503 when none is left)."""
        while not self._send(link, req):
            link.unreachable = True
            link = self.pick()
        log.info("request_routed", scheduler=link.addr, score=round(link.score(), 4))
        handle = RequestHandle(req.request_id, link)
        self._pending[req.request_id] = handle
        link.on_sent(req)
        return handle

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone, stop string hit); its later replies are dropped."""
        handle = self._forget(request_id)
        if handle is not None:
            self._send(handle.link, AbortRequest(request_id=request_id))

    def _forget(self, request_id: str) -> RequestHandle | None:
        handle = self._pending.pop(request_id, None)
        if handle is not None:
            handle.link.request_ids.discard(request_id)
        return handle

    def _send(self, link: SchedulerLink, msg) -> bool:
        if send_now(link.socket, encode(msg)):
            return True
        log.warning("scheduler_send_failed", scheduler=link.addr, msg=type(msg).__name__)
        return False

    # ------------------------------------------------------------ receiving

    async def _recv_loop(self) -> None:
        poller = zmq.asyncio.Poller()
        for link in self.links:
            poller.register(link.socket, zmq.POLLIN)
        while True:
            for socket, _ in await poller.poll(timeout=int(HEARTBEAT_S * 1000)):
                await self._drain(self._by_socket[socket])

    async def _drain(self, link: SchedulerLink) -> None:
        for _ in range(MAX_RECV_PER_TICK):
            try:
                frames = await link.socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self.on_frame(link, frames[-1])

    def on_frame(self, link: SchedulerLink, frame: bytes) -> None:
        """Decode and route one reply; a frame that does not decode is logged and dropped."""
        try:
            msg = gateway_reply_decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("bad_frame", scheduler=link.addr, error=str(e), size=len(frame))
            return
        now = time.monotonic()
        link.on_heard(now)
        match msg:
            case StepOutputs(outputs=outputs):
                for out in outputs:
                    self._deliver(out.request_id, out)
            case RequestError(request_id=rid):
                self._deliver(rid, msg)
            case SchedulerStats():
                link.on_report(msg, now)

    def _deliver(self, request_id: str, reply: Reply) -> None:
        handle = self._pending.get(request_id)
        if handle is None:
            return  # aborted or already finished: nothing waits for it
        handle.queue.put_nowait(reply)
        if is_final(reply):
            self._forget(request_id)

    # ------------------------------------------------------------ heartbeat

    async def _heartbeat_loop(self) -> None:
        while True:
            now = time.monotonic()
            for link in self.links:
                if now >= link.next_hello:
                    self._send_hello(link, now)
                if link.request_ids and now - link.last_seen >= STALE_AFTER_S:
                    self._fail_all(link, f"scheduler {link.addr} stopped responding")
            await asyncio.sleep(RETRY_HELLO_S)

    def _send_hello(self, link: SchedulerLink, now: float) -> None:
        """Not connected (yet) is no error: it is tried again shortly."""
        sent = send_now(link.socket, encode(GatewayHello(gateway_id=self.gateway_id)))
        link.next_hello = now + (HEARTBEAT_S if sent else RETRY_HELLO_S)
        if not sent and link.stats is not None:
            link.unreachable = True  # it had been heard from: its connection is gone

    def _fail_all(self, link: SchedulerLink, message: str) -> None:
        log.error("scheduler_lost", scheduler=link.addr, num_requests=len(link.request_ids))
        for rid in list(link.request_ids):
            self._deliver(rid, RequestError(request_id=rid, message=message, type="service_unavailable"))
