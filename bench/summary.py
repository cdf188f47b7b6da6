"""The benchmark figures the docs cite, kept in the source tree while the runs stay out of it.

Every benchmark writes its full result under `bench/results/` (git-ignored: a compare run holds
every request's timings, a megabyte or more). The runs the docs quote are copied, without their
per-request lists, into one small committed file of rows, `bench/summary.json`, and
`docs/results.md` is rendered from those rows alone, so a figure in the docs can always be traced
to the run that produced it and re-rendered on a fresh clone:

    superinfer bench summary --add NAME=bench/results/compare_....json --comparison KEY --title "..." --command "..."
    superinfer bench summary --current KEY=NAME   # make a run already in the summary KEY's current one
    superinfer bench summary --drop NAME
    superinfer bench summary --history        # every run kept, current ones marked
    superinfer bench summary                  # re-render docs/results.md from bench/summary.json

A comparison (`vllm-fp32`, `llama-cpp`, `pressure`, ... one key per peer, workload and model size)
has one current run: `current` maps each key to an entry's name, and the page shows only those, in
that order. Adding a run with `--comparison KEY` replaces KEY's current run; the older ones stay in
`entries` (and in git) but leave the page.

A test renders the committed rows and compares them with the committed page. (It lives beside
the rows, in the benchmarks' layer, because a compare run's table is bench/live/compare.py's.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUMMARY_JSON = ROOT / "bench" / "summary.json"
RESULTS_MD = ROOT / "docs" / "results.md"
MAX_LIST = 32  # longer lists are per-request or per-step records: the tables never read them

HEADER = """# Benchmark results

The current run of each comparison, rendered by `superinfer bench summary` from
`bench/summary.json` (each entry a run's result file less its per-request lists, with the commit
it ran at); regenerate it rather than edit it. Older runs stay in that file (`superinfer bench
summary --history`) and in git. How to run each benchmark: [benchmarks.md](benchmarks.md). Runs on
this project's 2-core machines, shared with other work, so figures drift between runs; compare
the sides of one run, not runs.
"""


def strip(value):
    """`value` with every list longer than MAX_LIST dropped (None in its place)."""
    if isinstance(value, dict):
        return {k: strip(v) for k, v in value.items()}
    if isinstance(value, list):
        return None if len(value) > MAX_LIST else [strip(v) for v in value]
    return value


def kind_of(body: dict) -> str:
    if "targets" in body and "config" in body:
        return "compare"
    if body.get("bench") == "kv":
        return "kv"
    if "prefill_tok_s" in body and "decode_ms_b1" in body:
        return "model"
    if "rows" in body and body.get("rows") and "policy" in body["rows"][0]:
        return "policies"
    if "rows" in body and body.get("rows") and "routing" in body["rows"][0]:
        return "routing"
    raise ValueError("not a result file `bench summary` knows (compare, kv, model, policies or routing)")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _model(body: dict) -> str:
    names = {"prefill_tok_s": "prefill, 512-token prompt (tok/s)", "decode_ms_b1": "decode step, batch 1 (ms)",
             "decode_ms_b16": "decode step, batch 16 (ms)"}
    rows = [[label, f"{body[k]['ours']:.1f}", f"{body[k]['transformers']:.1f}", f"{body['speedup'][k]:.2f}×"]
            for k, label in names.items()]
    return _table(["metric", "ours", "transformers", "ours vs transformers"], rows)


def _kv(body: dict) -> str:
    rows = [[m, f"{v['effective_gbps']:.2f}", f"{v['effective_gbps'] / body['memcpy_gbps']:.3f}×"]
            for m, v in body["modes"].items()]
    rows.append(["memcpy (the limit)", f"{body['memcpy_gbps']:.2f}", "1.000×"])
    return _table(["transfer mode", "effective GB/s (both ways)", "vs memcpy"], rows)


def _policies(body: dict) -> str:
    rows = [[r["policy"], f"{100 * r['ttft_attainment']:.1f}%", f"{100 * r['tbt_attainment']:.1f}%",
             f"{r['ttft_p50_ms']:.0f} ms", f"{r['tbt_p50_ms']:.0f} ms", str(r["rotations_out"]), str(r["recomputes"]),
             f"{100 * r['stall_ratio']:.2f}%"] for r in body["rows"]]
    return _table(["policy", "TTFT att.", "TBT att.", "TTFT p50", "TBT p50", "rotations out", "recomputes",
                   "stalled steps"], rows)


def _routing(body: dict) -> str:
    """`bench replicas` (simulated: replicas, rate per replica, the gateway's index) or
    `bench.live.replicas` (two pairs live: conversations/s) rows."""
    simulated = "replicas" in body["rows"][0]
    rows = []
    for r in body["rows"]:
        head = [str(r["replicas"]), f"{r['rate_per_replica']:g}"] if simulated else [f"{r['rate']:g}"]
        tail = [f"{r['index_peak_mib']:.1f} MiB, {r['index_events_per_s']:.0f}/s"] if simulated else []
        rows.append([*head, r["routing"], f"{100 * r['cached_token_share']:.1f}%",
                     f"{r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} ms", f"{100 * r['ttft_attainment']:.1f}%",
                     f"{100 * r['tbt_attainment']:.1f}%", *tail])
    head = ["replicas", "conv/s per replica"] if simulated else ["conv/s"]
    tail = ["gateway index (peak, events)"] if simulated else []
    return _table([*head, "routing", "prompt tokens from cache", "TTFT p50 / p90", "TTFT att.", "TBT att.", *tail], rows)


def when(entry: dict) -> str:
    """The run's date (from its file name or body) and the commit it ran at, as the page shows them."""
    stamp = (entry["body"].get("created") or entry.get("date") or entry["source"].removeprefix("compare_"))[:15]
    date = f"{stamp[:4]}-{stamp[4:6]}-{stamp[6:8]} {stamp[9:11]}:{stamp[11:13]} UTC" if stamp[:8].isdigit() else "undated"
    return date + (f" at `{entry['commit']}`" if entry.get("commit") else "")


def render_entry(entry: dict, keys: list[str]) -> str:
    from bench.live import compare  # the compare run's own table, so both pages agree

    body = entry["body"]
    table = {"compare": compare.markdown, "kv": _kv, "model": _model, "policies": _policies,
             "routing": _routing}[entry["kind"]](body)
    made = f", made by `{entry['command']}`" if entry.get("command") else ""
    parts = [f"## {entry['title']}", f"Current for {', '.join(f'`{k}`' for k in keys)}. "
             f"Run `{entry['source']}` ({when(entry)}){made}."]
    if entry.get("note"):
        parts.append(entry["note"])
    parts.append(table)
    return "\n\n".join(parts)


def current_entries(summary: dict) -> list[tuple[dict, list[str]]]:
    """Each entry that is some comparison's current run, once, with its keys, in `current`'s order."""
    by_name = {e["name"]: e for e in summary["entries"]}
    keys: dict[str, list[str]] = {}
    for key, name in summary.get("current", {}).items():
        if name not in by_name:
            raise ValueError(f"comparison {key!r} points at {name!r}, which is not in the summary")
        keys.setdefault(name, []).append(key)
    return [(by_name[name], ks) for name, ks in keys.items()]


def render(summary: dict) -> str:
    sections = [render_entry(e, ks) for e, ks in current_entries(summary)]
    return "\n\n".join([HEADER.rstrip("\n"), *sections]) + "\n"


def history(summary: dict) -> str:
    current = {name: key for key, name in summary.get("current", {}).items()}
    return "\n".join(f"{'*' if e['name'] in current else ' '} {e['name']:48} {e['source']:38} {when(e)}"
                     for e in summary["entries"])


def head_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def load(path: Path = SUMMARY_JSON) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"current": {}, "entries": []}


def add(summary: dict, name: str, source: Path, title: str, command: str | None, note: str | None,
        comparisons: list[str] = (), commit: str | None = None) -> dict:
    """`summary` with the run in `source` as entry `name` (replaced in place if there) and current for
    each of `comparisons`."""
    body = json.loads(source.read_text())
    entry = {"name": name, "title": title, "source": source.name, "kind": kind_of(body), "command": command,
             "note": note, "commit": commit, "body": strip(body)}
    entries = [e for e in summary["entries"] if e["name"] != name]
    index = next((i for i, e in enumerate(summary["entries"]) if e["name"] == name), len(entries))
    entries.insert(index, entry)
    current = dict(summary.get("current", {}))
    current.update({key: name for key in comparisons})
    return {"current": current, "entries": entries}


def drop(summary: dict, name: str) -> dict:
    """`summary` without entry `name`; a comparison whose current run it was has none until one is added."""
    return {"current": {k: n for k, n in summary.get("current", {}).items() if n != name},
            "entries": [e for e in summary["entries"] if e["name"] != name]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--add", metavar="NAME=PATH", help="copy the run in PATH (a result file) into the summary as NAME")
    p.add_argument("--title", help="with --add: the section's heading")
    p.add_argument("--command", help="with --add: the command that produced the run")
    p.add_argument("--note", help="with --add: a sentence under the heading")
    p.add_argument("--comparison", action="append", default=[], metavar="KEY",
                   help="with --add: make the run KEY's current one (repeat for a run that serves several)")
    p.add_argument("--commit", help="with --add: the commit the run's server ran at (default: HEAD)")
    p.add_argument("--current", action="append", default=[], metavar="KEY=NAME",
                   help="make NAME, already in the summary, KEY's current run")
    p.add_argument("--drop", metavar="NAME", help="remove NAME from the summary")
    p.add_argument("--history", action="store_true", help="list every run kept (* marks the current ones)")
    p.add_argument("--summary", type=Path, default=SUMMARY_JSON, help="the rows (default %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS_MD, help="the page (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    summary = load(args.summary)
    if args.add:
        name, sep, path = args.add.partition("=")
        if not sep or not args.title:
            print("--add takes NAME=PATH and needs --title")
            return 2
        try:
            summary = add(summary, name, Path(path), args.title, args.command, args.note, args.comparison,
                          args.commit or head_commit())
        except (OSError, ValueError) as e:
            print(f"cannot add {path}: {e}")
            return 2
    for item in args.current:
        key, sep, name = item.partition("=")
        if not sep or name not in {e["name"] for e in summary["entries"]}:
            print(f"--current takes KEY=NAME with NAME in the summary: {item!r}")
            return 2
        summary = {**summary, "current": {**summary.get("current", {}), key: name}}
    if args.drop:
        summary = drop(summary, args.drop)
    if args.history:
        print(history(summary))
        return 0
    page = render(summary)
    args.summary.write_text(json.dumps(summary, indent=1) + "\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page)
    print(f"{len(summary.get('current', {}))} comparisons, {len(summary['entries'])} runs -> {args.summary}, {args.out}")
    return 0
