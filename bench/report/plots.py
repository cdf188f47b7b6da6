"""The PNGs of the simulated figures: attainment vs rate, CDFs per policy, knob sweeps.
matplotlib is imported when a plot is drawn, so the benches run without it otherwise."""

from __future__ import annotations

from pathlib import Path

from bench.report.metrics import RequestRecord

KNOBS = ("transfer_mode", "xfer_budget", "alpha", "beta_f", "beta_b")  # what a simulated row varies


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_policy_cdfs(recs: dict[str, list[RequestRecord]], path: Path) -> None:
    """TTFT and TBT CDFs, one line per policy, the SLOs marked."""
    import numpy as np

    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for policy, rs in recs.items():
        for ax, values in ((axes[0], [r.ttft_s for r in rs if r.ok]), (axes[1], [g for r in rs for g in r.tbt_s])):
            xs = np.sort(np.asarray(values)) * 1e3
            ax.step(xs, np.arange(1, xs.size + 1) / max(xs.size, 1), where="post", label=policy)
    for ax, name, slo in ((axes[0], "TTFT", 5000), (axes[1], "TBT", 100)):
        ax.axvline(slo, color="red", linestyle="--", linewidth=1)
        ax.set(xscale="log", xlabel=f"{name} (ms)", ylabel="fraction <= x", title=f"{name} CDF under memory pressure")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_sweep(rows: list[dict], key: str, path: Path, title: str, by: str | None = None) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(str(r[by]) if by else "lvf", []).append(r)
    for name, rs in groups.items():
        rs = sorted(rs, key=lambda r: r[key])
        xs = [r[key] for r in rs]
        ax.plot(xs, [100 * r["ttft_attainment"] for r in rs], marker="o", label=f"TTFT {name}")
        ax.plot(xs, [100 * r["tbt_attainment"] for r in rs], marker="s", linestyle="--", label=f"TBT {name}")
    ax.set(xlabel=key, ylabel="SLO attainment (%)", ylim=(0, 102), title=title)
    if key == "xfer_budget":
        ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_attainment(rows: list[dict], out_dir: Path, title: str, name: str = "attainment") -> Path:
    """TTFT and TBT attainment vs rate, one line per policy (and knob set)."""
    plt = _plt()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    series: dict[str, list[dict]] = {}
    for r in rows:
        series.setdefault(line_label(r, rows), []).append(r)
    for ax, key, label in ((axes[0], "ttft_attainment", "TTFT"), (axes[1], "tbt_attainment", "TBT")):
        for name_, rs in series.items():
            rs = sorted(rs, key=lambda r: r["rate"])
            ax.plot([r["rate"] for r in rs], [100 * (r[key] or 0) for r in rs], marker="o", label=name_)
        ax.set(
            xlabel="request rate (req/s)",
            ylabel=f"{label} SLO attainment (%)",
            ylim=(0, 102),
            title=f"{label} — {title}",
        )
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def line_label(row: dict, rows: list[dict]) -> str:
    """The policy, plus every knob that varies across `rows`."""
    varying = [k for k in KNOBS if len({r[k] for r in rows}) > 1]
    return " ".join([row["policy"], *(f"{k}={row[k]}" for k in varying)])


# One colour per policy across every figure of the reproduction (the SuperInfer ones solid and
# thick, the baselines thin).
POLICY_COLORS = {
    "superinfer-artifact": "#d62728",
    "lvf-paper": "#ff7f0e",
    "lvf": "#2ca02c",
    "fcfs": "#1f77b4",
    "trtllm": "#9467bd",
    "lightllm": "#8c564b",
    "ltr": "#e377c2",
    "neo": "#7f7f7f",
    "sf": "#bcbd22",
    "wf": "#17becf",
}
POLICY_NAMES = {"fcfs": "vllm-v1"}


def _style(policy: str) -> dict:
    strong = policy in ("superinfer-artifact", "lvf-paper", "lvf")
    return {"color": POLICY_COLORS.get(policy, "black"), "linewidth": 2.2 if strong else 1.2, "marker": "o" if strong else "."}


def reproduction_figures(res: dict, out_dir: Path) -> None:
    """bench/figures/: Fig. 16 per model and data set (TTFT and TBT attainment vs req/s, the
    policy-agnostic knobs off) and the knob sweeps, from the compact rows."""
    plt = _plt()
    out_dir.mkdir(parents=True, exist_ok=True)
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in res["fig16"]:
        if r["knobs"] == "off":
            groups.setdefault((r["model"], r["dataset"]), []).append(r)
    for (model, ds), rows in groups.items():
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for ax, key, what in ((axes[0], "ttft_attainment", "TTFT"), (axes[1], "tbt_attainment", "TBT")):
            for p in POLICY_COLORS:
                rs = sorted((r for r in rows if r["policy"] == p), key=lambda r: r["rate"])
                if rs:
                    ax.plot([r["rate"] for r in rs], [100 * r[key] for r in rs], label=POLICY_NAMES.get(p, p), **_style(p))
            ax.set(xlabel="request rate (req/s)", ylabel=f"{what} SLO attainment (%)", ylim=(0, 102), title=f"{what}: {model}, {ds}")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        slug = model.lower().replace(".", "").replace("-", "")
        fig.savefig(out_dir / f"fig16_{slug}_{ds}.png", dpi=100, bbox_inches="tight")
        plt.close(fig)
    knobs = {k: rows for k, rows in res.get("knobs", {}).items() if rows}
    if len(knobs) > 1:
        fig, axes = plt.subplots(1, len(knobs), figsize=(4 * len(knobs), 3.5))
        for ax, (knob, rows) in zip(axes, knobs.items()):
            for p in ("lvf-paper", "lvf"):
                rs = sorted((r for r in rows if r["policy"] == p), key=lambda r: r[knob])
                xs = [r[knob] for r in rs]
                st = _style(p)
                ax.plot(xs, [100 * r["ttft_attainment"] for r in rs], label=f"{p} TTFT", **st)
                ax.plot(xs, [100 * r["tbt_attainment"] for r in rs], label=f"{p} TBT", linestyle="--", **st)
            ax.set(xlabel=knob + (" (blocks)" if knob == "xfer_budget" else ""), ylabel="SLO attainment (%)", ylim=(0, 102))
            if knob == "xfer_budget":
                ax.set_xscale("log")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.savefig(out_dir / "knobs.png", dpi=100, bbox_inches="tight")
        plt.close(fig)
