"""`superinfer scheduler`: the scheduler service (service.py) from its command line."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal

from services.scheduler.core import SchedulerConfig
from services.scheduler.service import SchedulerService
from shared import config, zmqsec
from shared.log import setup_logging


def run(args: argparse.Namespace) -> int:
    log = setup_logging("scheduler", args.log_level)
    if reason := zmqsec.refusal([args.bind, args.worker_bind, args.admin_bind], args.zmq_keys, zmqsec.SERVER):
        log.error("refusing to start", reason=reason)
        return 2
    service = SchedulerService(
        SchedulerConfig.from_flags(args),
        args.bind,
        args.worker_bind,
        log,
        args.pipeline_depth,
        args.step_trace,
        admin_bind=args.admin_bind,
        admin_token=args.admin_token or os.environ.get(config.ADMIN_TOKEN_ENV) or None,
        step_timeout_s=args.step_timeout,
        worker_wait_s=args.worker_wait,
        zmq_keys=args.zmq_keys,
    )
    metrics_server = service.observer.metrics.serve(args.metrics_host, args.metrics_port, log)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: setattr(service, "stopping", True))
        await service.run()

    asyncio.run(main())
    if metrics_server is not None:
        metrics_server.shutdown()
    log.info("scheduler stopped")
    return 0
