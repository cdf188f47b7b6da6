"""Virtual Lag Time (DESIGN.md, RotaSched), with per-request SLOs; as the paper defines it,
with no clamp:

    waiting for its first token:  VLT = now - t_arrival - beta_F * S_F   (< 0 within its slack)
    paused, has emitted tokens:   VLT = alpha * (now - t_last_token - beta_B * S_B)
    running:                      VLT = -(now - t_run_start)

Within each of the first two classes VLT is a decreasing function of a key that does not
depend on `now` (`lag_key`), so each class lives in a heap ordered by that key and the
scheduler merges the two heads by their actual VLT (`lag_vlt`).
"""

from __future__ import annotations

from .config import SchedulerConfig
from .request import Request, Status


def lag_key(req: Request, cfg: SchedulerConfig) -> float:
    """The time from which a paused request starts to lag."""
    if req.has_emitted:
        return req.last_token_time + cfg.beta_b * req.tbt_slo
    return req.arrival + cfg.beta_f * req.ttft_slo


def lag_vlt(key: float, emitted: bool, now: float, cfg: SchedulerConfig) -> float:
    lag = now - key
    return cfg.alpha * lag if emitted else lag


def running_vlt(req: Request, now: float) -> float:
    return -(now - req.run_start)


def vlt(req: Request, now: float, cfg: SchedulerConfig) -> float:
    if req.status is Status.RUNNING:
        return running_vlt(req, now)
    return lag_vlt(lag_key(req, cfg), req.has_emitted, now, cfg)
