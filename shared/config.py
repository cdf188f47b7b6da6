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
# How long a gateway holds a request whose scheduler was lost, waiting for another one.
DEFAULT_FAILOVER_GRACE_S = 30.0
# How long a scheduler holds a request while no worker is ready (one restarting loads its model).
DEFAULT_WORKER_WAIT_S = 120.0
# A folder where a worker keeps its converted float weights for the next one (a restart);
# `superinfer serve` sets it to its run folder (services/worker/weights_cache.py).
WEIGHTS_CACHE_ENV = "SUPERINFER_WEIGHTS_CACHE"

# The scheduler's admin socket (`superinfer queues|top|stats|abort|drain`): its address, and
# the environment variables the operator commands and the scheduler read.
DEFAULT_ADMIN_ADDR = "tcp://127.0.0.1:5559"
ADMIN_ADDR_ENV = "SUPERINFER_ADMIN"
ADMIN_TOKEN_ENV = "SUPERINFER_ADMIN_TOKEN"

# The gateway's API key, read from the environment (a command line is visible to every local
# user); vLLM's variable too, so an operator's existing setup carries over.
API_KEY_ENV = "SUPERINFER_API_KEY"
VLLM_API_KEY_ENV = "VLLM_API_KEY"

# ZeroMQ high-water marks (messages) and linger (ms) on close.
ZMQ_HWM = 10_000
ZMQ_LINGER_MS = 500

# Plans at the worker at once (services/scheduler/driver.py): 2 builds step t+1 while t
# computes, 1 waits for each result. The service's --pipeline-depth and the simulator's both
# default to `default_pipeline_depth`.
PIPELINE_DEPTHS = (1, 2)


def default_pipeline_depth(on_cpu: bool) -> int:
    """2 where a device computes beside the host (a GPU: a step takes a few ms, plan t+1 and
    its swap-ins must be ready before t ends); 1 where the host's cores compute. There a step
    takes 30-110 ms against a ~1 ms round trip for the next plan, and a plan built a step
    early keeps every request that arrives during step t out of step t+1: one more step of
    TTFT for each, to save that millisecond (measured: docs/design.md, "Scheduling and memory knobs")."""
    return 1 if on_cpu else 2


def default_mirror_watermark(on_cpu: bool) -> float:
    """From what share of the HBM blocks in use LVF mirrors synced blocks to DRAM (eager
    rotation). 0, always, where a GPU's copy engine moves them beside the compute; 0.5 where
    the host's cores compute: there a mirror is a memcpy on the cores the forward runs on, and
    mirroring every prompt's blocks with no preemption in sight stretched 16-stream prefill
    steps from ~400 to ~950 ms (docs/design.md, "Scheduling and memory knobs"). From half the pool a
    preemption is still far enough off for the mirrors to be made in time."""
    return 0.5 if on_cpu else 0.0


def default_slo_chunking(on_cpu: bool) -> bool:
    """Whether LVF caps a step's prefill tokens to keep its decodes within the TBT SLO. On where
    a GPU decodes: a decode step there takes a fraction of the SLO, a prefill chunk beside it
    can make it miss, and capping the chunk keeps every gap in (the simulator, `gh200`,
    Qwen2.5-32B, ShareGPT at 20 req/s: docs/design.md, "Scheduling and memory knobs"). Off where the
    host's cores compute: a CPU decode step takes most of the SLO by itself, so the cap leaves
    prompts a few tokens a step and each step's fixed cost is paid many times (measured live:
    8 streams 79 -> 63 tok/s, ShareGPT TBT gaps 94 -> 71%)."""
    return not on_cpu


# ---------------------------------------------------------------- KV geometry
# The scheduler's other knobs live in services/scheduler/core/config.py (SchedulerConfig).

DEFAULT_BLOCK_SIZE = 16  # tokens per KV block (the worker's --block-size)


def kv_segment_bytes(num_kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int) -> int:
    """One layer's K (or V) of one block: the unit a layer-first layout (vLLM's) copies."""
    return block_size * num_kv_heads * head_dim * dtype_bytes


def kv_block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int) -> int:
    """One KV block: K and V of `block_size` tokens in every layer, one region in the pools'
    block-first layout (services/worker/kv_pool.py)."""
    return num_layers * 2 * kv_segment_bytes(num_kv_heads, head_dim, block_size, dtype_bytes)


def ipc_addresses(run_dir: str) -> tuple[str, str]:
    """(scheduler address for gateways, worker address) inside a runtime directory."""
    return f"ipc://{run_dir}/scheduler.sock", f"ipc://{run_dir}/worker.sock"
