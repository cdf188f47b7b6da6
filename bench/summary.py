"""The benchmark figures the docs cite, kept in the source tree while the runs stay out of it.

Every benchmark writes its full result under `bench/results/` (git-ignored: a compare run holds
every request's timings, a megabyte or more). The runs the docs quote are copied, without their
per-request lists, into one small committed file of rows, `bench/summary.json`, and
`docs/results.md` is rendered from those rows alone, so a figure in the docs can always be traced
to the run that produced it and re-rendered on a fresh clone:

    superinfer bench summary --add NAME=bench/results/compare_....json --title "..." --command "..."
    superinfer bench summary --drop NAME
    superinfer bench summary                  # re-render docs/results.md from bench/summary.json

A test renders the committed rows and compares them with the committed page. (It lives beside
the rows, in the benchmarks' layer, because a compare run's table is bench/live/compare.py's.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUMMARY_JSON = ROOT / "bench" / "summary.json"
RESULTS_MD = ROOT / "docs" / "results.md"
MAX_LIST = 32  # longer lists are per-request or per-step records: the tables never read them

HEADER = """# Benchmark results

Rendered by `superinfer bench summary` from the rows in `bench/summary.json` (each entry a run's
result file less its per-request lists); regenerate it rather than edit it. How to run each
benchmark: [benchmarks.md](benchmarks.md). Runs on this project's 2-core machines, shared with
other work, so figures drift between runs; compare the two sides of one run, not runs.
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
    raise ValueError("not a result file `bench summary` knows (compare, kv, model or policies)")


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


def render_entry(entry: dict) -> str:
    from bench.live import compare  # the compare run's own table, so both pages agree

    body = entry["body"]
    table = {"compare": compare.markdown, "kv": _kv, "model": _model, "policies": _policies}[entry["kind"]](body)
    parts = [f"## {entry['title']}", f"Run `{entry['source']}`" + (f", made by `{entry['command']}`" if entry.get("command") else "") + "."]
    if entry.get("note"):
        parts.append(entry["note"])
    parts.append(table)
    return "\n\n".join(parts)


def render(summary: dict) -> str:
    return "\n\n".join([HEADER.rstrip("\n"), *(render_entry(e) for e in summary["entries"])]) + "\n"


def load(path: Path = SUMMARY_JSON) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"entries": []}


def add(summary: dict, name: str, source: Path, title: str, command: str | None, note: str | None) -> dict:
    body = json.loads(source.read_text())
    entry = {"name": name, "title": title, "source": source.name, "kind": kind_of(body), "command": command,
             "note": note, "body": strip(body)}
    entries = [e for e in summary["entries"] if e["name"] != name]
    index = next((i for i, e in enumerate(summary["entries"]) if e["name"] == name), len(entries))
    entries.insert(index, entry)
    return {"entries": entries}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--add", metavar="NAME=PATH", help="copy the run in PATH (a result file) into the summary as NAME")
    p.add_argument("--title", help="with --add: the section's heading")
    p.add_argument("--command", help="with --add: the command that produced the run")
    p.add_argument("--note", help="with --add: a sentence under the heading")
    p.add_argument("--drop", metavar="NAME", help="remove NAME from the summary")
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
            summary = add(summary, name, Path(path), args.title, args.command, args.note)
        except (OSError, ValueError) as e:
            print(f"cannot add {path}: {e}")
            return 2
    if args.drop:
        summary = {"entries": [e for e in summary["entries"] if e["name"] != args.drop]}
    args.summary.write_text(json.dumps(summary, indent=1) + "\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(summary))
    print(f"{len(summary['entries'])} runs -> {args.summary}, {args.out}")
    return 0
