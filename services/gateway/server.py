"""Starting and stopping the gateway.

`run` blocks until SIGINT/SIGTERM, then stops within about two seconds: the listener
closes, in-flight handlers get `SHUTDOWN_GRACE_S` to finish and are then cancelled (each
cancelled request is aborted at its scheduler), and the sockets close with bounded linger.
"""

from __future__ import annotations

import asyncio
import signal

import structlog
from aiohttp import web

from services.gateway.app import GatewayState, build_app
from services.gateway.routing import DEFAULT_ROUTING
from services.gateway.scheduler_client import SchedulerClient
from shared import zmqsec
from shared.config import DEFAULT_FAILOVER_GRACE_S
from shared.log import setup_logging
from shared.modelfile import read_model_config, resolve_model_path
from shared.tokenizer import load_tokenizer

SHUTDOWN_GRACE_S = 1.0
log = structlog.get_logger()


def run(
    host: str,
    port: int,
    scheduler_addrs: list[str],
    model: str | None,
    api_key: str | None = None,
    zmq_keys: str | None = None,
    failover_grace_s: float = DEFAULT_FAILOVER_GRACE_S,
    routing: str = DEFAULT_ROUTING,
    **options,
) -> int:
    """Serve until a signal; 2 at once, before the tokenizer loads, when the scheduler
    addresses need keys that are missing or unreadable. `options`: `serve`'s."""
    setup_logging("gateway")
    if reason := zmqsec.refusal(scheduler_addrs, zmq_keys, zmqsec.CLIENT):
        log.error("refusing to start", service="gateway", reason=reason)
        return 2
    try:
        client = {"zmq_keys": zmq_keys, "failover_grace_s": failover_grace_s, "routing": routing}
        asyncio.run(serve(host, port, scheduler_addrs, model, api_key, client=client, **options))
    finally:
        log.info("gateway_stopped", service="gateway")
    return 0


async def serve(
    host: str,
    port: int,
    scheduler_addrs: list[str],
    model: str | None,
    api_key: str | None = None,
    stop: asyncio.Event | None = None,
    client: dict | None = None,
    served_model_names: list[str] | None = None,
    seed: int | None = None,
    tool_call_parser: str | None = None,
) -> None:
    """Serve until `stop` is set (by default: until SIGINT or SIGTERM); `client` holds the
    `SchedulerClient` options (keys, failover grace). `served_model_names`: the names the
    model answers to (default: its own); `seed`: see `GatewayState.default_seed`;
    `tool_call_parser`: the tool-call format (tools.py; default: the chat template's)."""
    stop = stop or _stop_on_signals()
    structlog.contextvars.bind_contextvars(service="gateway")
    path = resolve_model_path(model)
    tokenizer = await asyncio.to_thread(load_tokenizer, path)
    config = await asyncio.to_thread(read_model_config, path)
    state = GatewayState(
        SchedulerClient(scheduler_addrs, **(client or {})),
        tokenizer,
        config,
        api_key,
        served_model_names=served_model_names or [],
        seed=seed,
        root=str(path.resolve()),
        tool_call_parser=tool_call_parser,
    )
    runner = web.AppRunner(
        build_app(state), handler_cancellation=True, shutdown_timeout=SHUTDOWN_GRACE_S, access_log=None
    )
    await state.client.start()
    try:
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        log.info(
            "gateway_listening", host=host, port=port, model=state.names()[0], schedulers=scheduler_addrs
        )
        await stop.wait()
    finally:
        await runner.cleanup()
        await state.client.close()


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop
