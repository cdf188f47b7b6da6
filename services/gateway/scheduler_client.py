"""The gateway's side of the gateway <-> scheduler sockets, and routing between schedulers.

One DEALER per scheduler address (its routing id is the gateway id, so a reconnect keeps
the same identity). A single receive task polls them all, drains at most
`MAX_RECV_PER_TICK` frames per socket per tick, and routes each reply to its request's
queue; a heartbeat task says hello every second.

Failover: a scheduler is lost when its connection closes (a socket monitor reports it at
once), when it goes quiet for `STALE_AFTER_S`, or when it comes back as a new instance (a
new `scheduler_id`). Its requests are not failed: each handle keeps the request and the
tokens streamed so far, and is resubmitted — prompt plus those tokens, under a fresh wire
id — to the best scheduler with a ready worker or, while none has one, to one that is there
and is getting its worker back (it holds the request, for at most its `--worker-wait`: a
worker restart is a recovery in progress, not a lost request). The client's stream just
pauses. Only when no scheduler is reachable for `failover_grace_s` does the request fail
("service_unavailable", with the last refusal it got, if any). A request held by a scheduler
without a worker moves to one with a ready worker as soon as there is one. The lost
scheduler, if it ever answers again, is first told to abort what it still runs for us; one
that aborted our requests because it took this gateway for gone (`GATEWAY_SILENT`: we were
frozen, or cut off) gets them back.

Routing: `pick()` sends each new request where `--routing` says (routing.py: the cache-aware
score, documented there once, from each scheduler's load report and its prefix-cache events;
or the lowest `headroom_score`, headroom.py; or round-robin), ties taken round-robin. Failover
resubmissions go by headroom. A scheduler leaves the rotation when it has not been heard from
for `STALE_AFTER_S` (its load reports double as heartbeats) or when a send to it fails (its
connection is gone), and comes back with its next message.

    pick(prompt_ids, session) -> SchedulerLink    submit(AddRequest, link) -> RequestHandle
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
from zmq.utils.monitor import parse_monitor_message

from services.gateway.errors import unavailable
from services.gateway.headroom import headroom_score, num_blocks
from services.gateway.request_handle import RequestHandle
from services.gateway.routing import (
    DEFAULT_ROUTING, SHORT_OF_HEADROOM, UNFITTED, LinkCache, Router, predicted_ttft,
)
from shared import zmqsec
from shared.config import DEFAULT_FAILOVER_GRACE_S, ZMQ_HWM, ZMQ_LINGER_MS
from shared.protocol import (
    GATEWAY_SILENT,
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

log = structlog.get_logger()
Reply = TokenOutput | RequestError
# A resubmission refused with one of these waits for another try, not the client's error.
RETRY_ELSEWHERE = ("overloaded", "service_unavailable")


class SchedulerLink:
    """One scheduler: its socket, its latest load report, and the requests it serves."""

    def __init__(self, addr: str, socket: zmq.asyncio.Socket) -> None:
        self.addr = addr
        self.socket = socket
        self.stats: SchedulerStats | None = None
        self.last_seen = float("-inf")
        self.request_ids: set[str] = set()  # wire ids of the requests it serves
        self.abandoned: set[str] = set()  # wire ids to abort when it is heard from again
        self.next_hello = 0.0
        self.unreachable = False  # a send failed: out of rotation until it is heard from again
        # Requests sent since the last load report, which does not count them yet.
        self.num_unreported = 0
        self.num_unreported_blocks = 0
        self.num_unreported_tokens = 0  # of their prompts, not held there (as predicted at pick)
        self.predicted_miss: int | None = None  # the last pick's, for the request sent next
        self.cache = LinkCache()  # its prefix cache, as its reports told (routing.py)
        # Routed here: requests, their prompt tokens, and those served from its prefix cache.
        self.num_routed = 0
        self.num_routed_prompt_tokens = 0
        self.num_routed_cached_tokens = 0

    def is_live(self, now: float) -> bool:
        return self.stats is not None and not self.unreachable and now - self.last_seen < STALE_AFTER_S

    def routable(self, now: float) -> bool:
        return self.is_live(now) and self.stats.worker_ready

    def holds(self, now: float) -> bool:
        """There, not draining, its worker not ready: it holds a resubmission until one is."""
        return self.is_live(now) and not self.stats.worker_ready and not self.stats.draining

    def score(self) -> float:
        return headroom_score(self.stats, self.num_unreported, self.num_unreported_blocks)

    def is_new_instance(self, stats: SchedulerStats) -> bool:
        return self.stats is not None and stats.scheduler_id != self.stats.scheduler_id

    def short_of_headroom(self) -> bool:
        return self.score() >= SHORT_OF_HEADROOM

    def predict(self, num_prompt: int, keys: list[int], unfitted: tuple[float, float] = UNFITTED) -> float:
        """Its predicted TTFT for a prompt of `num_prompt` tokens whose block keys are `keys`."""
        num_hit, num_dram = self.cache.match(keys)
        self.predicted_miss = max(0, num_prompt - num_hit * self.stats.block_size)
        return predicted_ttft(self.stats, num_prompt, num_hit, num_dram, self.num_unreported_tokens, unfitted)

    def on_sent(self, req: AddRequest) -> None:
        self.request_ids.add(req.request_id)
        self.num_unreported += 1
        self.num_unreported_blocks += num_blocks(req, self.stats.block_size if self.stats else 0)
        num_prompt = len(req.prompt_token_ids) + len(req.output_token_ids)
        miss = self.predicted_miss
        self.num_unreported_tokens += num_prompt if miss is None else min(miss, num_prompt)
        self.predicted_miss = None
        self.num_routed += 1
        self.num_routed_prompt_tokens += num_prompt

    def on_report(self, stats: SchedulerStats, now: float) -> None:
        self.cache.on_report(stats.cache_seq, stats.cache)
        # Kept without its events (applied above): /health and /metrics show the rest.
        self.stats = stats if stats.cache is None else msgspec.structs.replace(stats, cache=None)
        self.num_unreported = self.num_unreported_blocks = self.num_unreported_tokens = 0
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
    def __init__(
        self,
        addrs: list[str],
        gateway_id: str | None = None,
        failover_grace_s: float = DEFAULT_FAILOVER_GRACE_S,
        zmq_keys: str | None = None,
        routing: str = DEFAULT_ROUTING,
    ) -> None:
        if not addrs:
            raise ValueError("at least one scheduler address is needed")
        self.router = Router(routing)
        self.gateway_id = gateway_id or f"gw-{uuid.uuid4().hex[:12]}"
        self.failover_grace_s = failover_grace_s
        self._ctx = zmq.asyncio.Context()
        self._curve = zmqsec.Curve(self._ctx, zmq_keys, log)  # every scheduler is a server to us
        self.links = [SchedulerLink(a, self._socket(a)) for a in addrs]
        self._by_socket = {link.socket: link for link in self.links}
        # A closed connection is reported by each socket's monitor at once, not after a timeout.
        self._by_monitor = {link.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED): link for link in self.links}
        self._handles: dict[str, RequestHandle] = {}  # request id -> every live request
        self._pending: dict[str, RequestHandle] = {}  # wire id -> those at a scheduler now
        self._orphans: dict[str, RequestHandle] = {}  # request id -> those waiting for one
        self._tasks: list[asyncio.Task] = []

    def _socket(self, addr: str) -> zmq.asyncio.Socket:
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.ROUTING_ID, self.gateway_id.encode())
        s.setsockopt(zmq.SNDHWM, ZMQ_HWM)
        s.setsockopt(zmq.RCVHWM, ZMQ_HWM)
        s.setsockopt(zmq.LINGER, ZMQ_LINGER_MS)
        s.setsockopt(zmq.IMMEDIATE, 1)  # queue only on live connections: a send to a gone peer fails fast
        self._curve.secure_client(s, addr)
        s.connect(addr)
        return s

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._heartbeat_loop())]

    async def close(self) -> None:
        """Abort what is still running (no orphans left in the schedulers), then close."""
        for rid in list(self._handles):
            self.abort(rid)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.close_sockets()

    def close_sockets(self) -> None:
        for monitor, link in self._by_monitor.items():
            link.socket.disable_monitor()
            monitor.close(linger=0)
        for link in self.links:
            link.socket.close(linger=ZMQ_LINGER_MS)
        self._ctx.term()

    # ------------------------------------------------------------ requests

    def live_links(self) -> list[SchedulerLink]:
        now = time.monotonic()
        return [link for link in self.links if link.routable(now)]

    def live_stats(self) -> list[SchedulerStats]:
        return [link.stats for link in self.live_links()]

    def pick(self, prompt_ids: list[int] | None = None, session: str | None = None) -> SchedulerLink:
        """Where a new request with this prompt (and session, if any) goes, by the router's
        routing (routing.py). 503 when no scheduler is reachable, or none has a ready worker."""
        link = self.router.pick(self.links, time.monotonic(), prompt_ids or [], session)
        if link is None:
            now = time.monotonic()
            if any(link.is_live(now) for link in self.links):
                raise unavailable("no model worker is ready (starting or restarting); retry shortly")
            raise unavailable("no scheduler is reachable; retry shortly")
        return link

    def _best(self) -> SchedulerLink | None:
        return self.router.best_headroom(self.links, time.monotonic())

    def _holder(self, now: float, handle: RequestHandle) -> SchedulerLink | None:
        """A scheduler getting its worker back, to hold a resubmission while none is ready
        (not one that held it in vain already)."""
        return next((link for link in self.links if link.holds(now) and link.addr not in handle.refused_by), None)

    def submit(self, req: AddRequest, link: SchedulerLink) -> RequestHandle:
        """Send to `link`; if its connection is gone, it leaves the rotation and the next
        best scheduler gets the request (503 when none is left)."""
        handle = RequestHandle(req, link)
        while not self._send(link, req):
            link.unreachable = True
            link = self.pick()
        self._track(handle, link, req)
        self._handles[req.request_id] = handle
        return handle

    def _track(self, handle: RequestHandle, link: SchedulerLink, sent: AddRequest) -> None:
        log.info("request_routed", request_id=handle.request_id, scheduler=link.addr, score=round(link.score(), 4))
        handle.link = link
        self._pending[handle.wire_id] = handle
        link.on_sent(sent)

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone, stop string hit); its later replies are dropped."""
        handle = self._handles.get(request_id)
        if handle is None:
            return
        at_scheduler = handle.wire_id in self._pending
        self._forget(handle)
        if at_scheduler and not self._send(handle.link, AbortRequest(request_id=handle.wire_id)):
            handle.link.abandoned.add(handle.wire_id)  # told when it is heard from again

    def _forget(self, handle: RequestHandle) -> None:
        self._handles.pop(handle.request_id, None)
        self._orphans.pop(handle.request_id, None)
        self._unpend(handle)

    def _unpend(self, handle: RequestHandle) -> None:
        if self._pending.pop(handle.wire_id, None) is not None:
            handle.link.request_ids.discard(handle.wire_id)

    def _send(self, link: SchedulerLink, msg) -> bool:
        if send_now(link.socket, encode(msg)):
            return True
        log.warning("scheduler_send_failed", scheduler=link.addr, msg=type(msg).__name__)
        return False

    # ------------------------------------------------------------ receiving

    async def _recv_loop(self) -> None:
        poller = zmq.asyncio.Poller()
        for socket in (*self._by_monitor, *self._by_socket):
            poller.register(socket, zmq.POLLIN)
        while True:
            ready = dict(await poller.poll(timeout=int(HEARTBEAT_S * 1000)))
            # Closed connections first: a restarted scheduler's first report must not be
            # taken for the lost instance's.
            for monitor, link in self._by_monitor.items():
                if monitor in ready:
                    await self._on_monitor(monitor, link)
            for socket, link in self._by_socket.items():
                if socket in ready:
                    await self._drain(link)

    async def _on_monitor(self, monitor: zmq.asyncio.Socket, link: SchedulerLink) -> None:
        while True:
            try:
                parse_monitor_message(await monitor.recv_multipart(flags=zmq.NOBLOCK))
            except zmq.Again:
                return
            self._lose(link, "its connection closed")

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
        self._on_heard(link, now)
        match msg:
            case StepOutputs(outputs=outputs):
                for out in outputs:
                    self._deliver(out.request_id, out)
            case RequestError(request_id=rid):
                self._deliver(rid, msg)
            case SchedulerStats():
                if link.is_new_instance(msg):
                    self._lose(link, "it restarted")
                link.on_report(msg, now)

    def _on_heard(self, link: SchedulerLink, now: float) -> None:
        """Before anything else reaches a scheduler that was lost and answers again, it is
        told to abort what it still runs for us: those requests live elsewhere now."""
        link.on_heard(now)
        for wire_id in link.abandoned:
            self._send(link, AbortRequest(request_id=wire_id))
        link.abandoned.clear()

    def _deliver(self, wire_id: str, reply: Reply) -> None:
        handle = self._pending.get(wire_id)
        if handle is None:
            return  # aborted, finished or resubmitted: nothing waits for it here
        if isinstance(reply, RequestError) and reply.type == GATEWAY_SILENT:
            self._unpend(handle)  # aborted there while we were silent: it goes out again now
            self._orphan(handle, time.monotonic())
            return
        if isinstance(reply, RequestError) and handle.lost_at is not None and reply.type in RETRY_ELSEWHERE:
            self._unpend(handle)  # a resubmission refused for now: try again within the grace period
            handle.last_refusal = reply.message
            handle.refused_by.add(handle.link.addr)
            self._orphans[handle.request_id] = handle
            handle.orphaned_at = handle.orphaned_at or time.monotonic()
            return
        if isinstance(reply, TokenOutput):
            handle.link.num_routed_cached_tokens += reply.num_cached_tokens
            handle.token_ids += reply.token_ids
            handle.lost_at = handle.orphaned_at = handle.last_refusal = None
            handle.refused_by.clear()
        if handle.wire_id != handle.request_id:
            reply = msgspec.structs.replace(reply, request_id=handle.request_id)
        handle.queue.put_nowait(reply)
        if is_final(reply):
            self._forget(handle)

    # ------------------------------------------------------------ failover

    def _lose(self, link: SchedulerLink, reason: str) -> None:
        """The scheduler behind `link` is gone, or is not the instance our requests went to:
        out of rotation until it reports again, and its requests wait for resubmission."""
        link.stats = None
        link.cache.forget()  # its blocks are not trusted: the instance that reports next sends its own
        if not link.request_ids:
            return
        log.error("scheduler_lost", scheduler=link.addr, reason=reason, num_requests=len(link.request_ids))
        now = time.monotonic()
        for wire_id in link.request_ids:
            self._orphan(self._pending.pop(wire_id), now)
        link.abandoned |= link.request_ids
        link.request_ids.clear()

    def _orphan(self, handle: RequestHandle, now: float) -> None:
        """`handle` is at no scheduler from `now`: a fresh failover grace."""
        handle.lost_at = handle.lost_at or now
        handle.orphaned_at = now
        self._orphans[handle.request_id] = handle

    def _migrate_held(self, now: float) -> None:
        """Requests held by a scheduler whose worker is not ready go to one whose worker is,
        as soon as there is one (the holding scheduler is told to abort them)."""
        if not any(link.routable(now) and link.score() < math.inf for link in self.links):
            return
        for link in self.links:
            if link.stats is None or link.stats.worker_ready or not link.request_ids:
                continue
            log.warning("requests_moved", scheduler=link.addr, reason="worker not ready", num=len(link.request_ids))
            for wire_id in list(link.request_ids):
                handle = self._pending[wire_id]
                self._unpend(handle)
                if not self._send(link, AbortRequest(request_id=wire_id)):
                    link.abandoned.add(wire_id)
                self._orphan(handle, now)

    def _resubmit_orphans(self, now: float) -> None:
        """Oldest first, each to the best scheduler with a ready worker, else to one getting
        its worker back; past the grace period, an error."""
        for handle in list(self._orphans.values()):
            if handle.num_generated() >= handle.req.params.max_tokens:  # only its final word was lost
                self._forget(handle)
                handle.queue.put_nowait(TokenOutput(handle.request_id, [], "length"))
            elif now - handle.orphaned_at > self.failover_grace_s:
                self._forget(handle)
                message = f"its scheduler was lost and none took it back within {self.failover_grace_s:g}s"
                if handle.last_refusal:
                    message += f"; the last refusal: {handle.last_refusal}"
                handle.queue.put_nowait(RequestError(handle.request_id, message, "service_unavailable"))
            elif (link := self._best() or self._holder(now, handle)) is not None:
                req = handle.resubmission()
                if not self._send(link, req):
                    link.unreachable = True
                    continue
                del self._orphans[handle.request_id]
                self._track(handle, link, req)
                log.warning("request_resubmitted", request_id=handle.request_id, num_tokens=len(req.output_token_ids))

    # ------------------------------------------------------------ heartbeat

    async def _heartbeat_loop(self) -> None:
        while True:
            now = time.monotonic()
            for link in self.links:
                if now >= link.next_hello:
                    self._send_hello(link, now)
                if link.stats is not None and now - link.last_seen >= STALE_AFTER_S:
                    self._lose(link, "it stopped responding")
            self._migrate_held(now)
            if self._orphans:
                self._resubmit_orphans(now)
            await asyncio.sleep(RETRY_HELLO_S)

    def _send_hello(self, link: SchedulerLink, now: float) -> None:
        """Not connected (yet) is no error: it is tried again shortly."""
        hello = GatewayHello(gateway_id=self.gateway_id, want_cache=link.cache.wants_snapshot)
        sent = send_now(link.socket, encode(hello))
        link.next_hello = now + (HEARTBEAT_S if sent else RETRY_HELLO_S)
        if not sent and link.stats is not None:
            link.unreachable = True  # it had been heard from: its connection is gone
