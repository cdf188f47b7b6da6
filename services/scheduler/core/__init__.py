"""The pure scheduler core: request states, two-tier block pools, RotaSched policies.

No asyncio, zmq, torch or clock here; `now` is always a parameter.
"""

from .config import POLICIES, SchedulerConfig
from .invariants import check_invariants
from .request import Request, Status
from .scheduler import Overloaded, SchedulerCore

__all__ = ["POLICIES", "Overloaded", "Request", "SchedulerConfig", "SchedulerCore", "Status", "check_invariants"]
