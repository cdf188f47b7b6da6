"""Defaults shared by the services and the CLI.

The embedded default (`superinfer serve`) wires the three services over ipc:// sockets
in a private runtime directory; services started alone use tcp:// addresses.
"""

from __future__ import annotations

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000

# tcp defaults for services started one by one (`superinfer gateway|scheduler|worker`).
DEFAULT_SCHEDULER_ADDR = "tcp://127.0.0.1:5557"  # gateways connect here
DEFAULT_WORKER_ADDR = "tcp://127.0.0.1:5558"  # scheduler binds, worker connects

DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_BATCHED_TOKENS = 512  # chunked-prefill token budget per step
DEFAULT_MAX_NUM_SEQS = 64  # requests per step at most

# ZeroMQ high-water marks (messages) and linger (ms) on close.
ZMQ_HWM = 10_000
ZMQ_LINGER_MS = 500


def ipc_addresses(run_dir: str) -> tuple[str, str]:
    """(scheduler address for gateways, worker address) inside a runtime directory."""
    return f"ipc://{run_dir}/scheduler.sock", f"ipc://{run_dir}/worker.sock"
# How long a gateway holds a request whose scheduler was lost, waiting for another one.
DEFAULT_FAILOVER_GRACE_S = 30.0
