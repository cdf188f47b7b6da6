"""What the reports read from simulated rows, and the paper's own figures they compare with."""

from __future__ import annotations

from services.scheduler.core import POLICIES

BASELINES = tuple(p for p in POLICIES if p != "lvf")
PAPER_STEP = {"schedule_ms": 7.6, "transfer_ms": 15.8, "model_ms": 69.8, "stall_pct": 0.021}
PAPER_TABLE1 = {"naive": "~10 GB/s, 1556 ms", "duplex": "181+179 GB/s, 46.8 ms", "ideal": "41.7 ms"}


def at(rows: list[dict], policy: str, rate: float, **knobs) -> dict:
    return next(
        r for r in rows if r["policy"] == policy and r["rate"] == rate and all(r[k] == v for k, v in knobs.items())
    )


def pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def operating_points(res: dict) -> dict[int, list[dict]]:
    """HBM blocks -> that Fig. 16's rows: the profile's pool first, then the cut ones."""
    out: dict[int, list[dict]] = {}
    for r in [*res["fig16"], *res["fig16_pressure"]]:
        out.setdefault(r["num_hbm_blocks"], []).append(r)
    return out


def dig(d, path: tuple[str, ...]):
    """The value at `path` (keys, outermost first) in nested dicts, or None where one is missing."""
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def knob_rows(res: dict) -> dict[str, list[dict]]:
    """Knob (alpha, beta_f, beta_b) -> the rows of its sweep, kept as `fig_<knob>`."""
    return {name.removeprefix("fig_"): rows for name, rows in res.items() if name.startswith("fig_")}


def tbt_behind(rows: list[dict], rate: float) -> float:
    """Points by which LVF's TBT attainment at `rate` trails the best policy's."""
    return 100 * (max(r["tbt_attainment"] for r in rows if r["rate"] == rate) - at(rows, "lvf", rate)["tbt_attainment"])
