"""The Python half of bench/gpu_check.sh: a served run and the report.

    python -m bench.gpu_check served --device cuda --dtype float32 --json DEST/served_cuda.json
    python -m bench.gpu_check report WORK --dest DEST   # DEST/gpu_check.json and .md; rc 1 on a miss

`served` starts `superinfer serve` on one device with a KV pool small enough that requests
rotate between HBM and DRAM, sends the same greedy requests at once, and records their text
and the pipeline's stall ratio from the step trace. `report` gathers what the shell script
left in WORK (pytest's summary line, the KV transfer benchmarks, the served runs) into one
JSON and one Markdown table, with a verdict per check.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPTS = [
    "Hi!",
    "What is the capital of France?",
    "Write a short poem about the sea, in four lines.",
    "Explain why the sky is blue during the day and red at sunset, for a ten-year-old.",
    "List three uses of a paper clip.",
    "Translate 'good morning' into Spanish, French and German.",
    "What is 17 times 23? Show the steps.",
    "Name the planets of the solar system in order from the sun.",
]
MAX_TOKENS = 40
HBM_BLOCKS = 20  # 320 tokens for 8 requests of up to ~70: the scheduler must rotate


def complete(base_url: str, model: str, prompt: str) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    req = urllib.request.Request(
        base_url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())["choices"][0]["text"]


def served(args: argparse.Namespace) -> int:
    from bench.live.policies import stall_ratio
    from bench.live.server import start_server

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        trace = Path(tmp) / "trace.jsonl"
        t0 = time.perf_counter()
        server = start_server(
            Path(tmp),
            "--device", args.device,
            "--dtype", args.dtype,
            "--hbm-blocks", str(HBM_BLOCKS),
            "--dram-gb", "0.5",
            "--step-trace", str(trace),
        )  # fmt: skip
        started_s = time.perf_counter() - t0
        try:
            t1 = time.perf_counter()
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                texts = list(pool.map(lambda p: complete(server.base_url, server.model, p), PROMPTS))
            serve_s = time.perf_counter() - t1
            stats = server.scheduler_stats()
        finally:
            server.stop()
        result = {
            "device": args.device,
            "dtype": args.dtype,
            "hbm_blocks": HBM_BLOCKS,
            "startup_s": round(started_s, 2),
            "serve_s": round(serve_s, 2),
            "texts": texts,
            **stall_ratio(trace),
            "rotations_out": stats.get("num_rotations_out"),
            "blocks_swapped_out": stats.get("num_blocks_swapped_out"),
        }
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"served on {args.device} ({args.dtype}): {len(texts)} requests in {serve_s:.1f} s, "
          f"{result['steps']} steps, stall ratio {result['stall_ratio']}, rotations {result['rotations_out']}")
    return 0


# ---------------------------------------------------------------- the report


def load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def check(name: str, ok: bool | None, detail: str) -> dict:
    return {"check": name, "status": "pass" if ok else ("missing" if ok is None else "FAIL"), "detail": detail}


def transfer_checks(kv: dict | None, name: str, dry_run: bool) -> list[dict]:
    """The benchmark's goals; on a CPU dry run they are figures only (host memory has no
    separate link per direction)."""
    if kv is None:
        return [check(f"kv {name}", None, "no result (the benchmark failed or was skipped)")]
    out = []
    for goal, g in kv.get("goals", {}).items():
        row = check(f"kv {name}: {goal}", g["met"] or dry_run, f"{g['value']} (target >= {g['target']})")
        if dry_run:
            row["status"] = "figure (dry run)"
        out.append(row)
    return out


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def served_checks(served: dict[str, dict | None]) -> list[dict]:
    cpu, gpu, auto = (served[k] for k in ("cpu", "cuda", "cuda_auto"))
    out = []
    if cpu is None or gpu is None:
        out.append(check("served greedy tokens: cuda float32 == cpu float32", None, "a served run is missing"))
    else:
        same = sum(a == b for a, b in zip(cpu["texts"], gpu["texts"]))
        out.append(check("served greedy tokens: cuda float32 == cpu float32", same == len(cpu["texts"]),
                         f"{same}/{len(cpu['texts'])} requests identical"))  # fmt: skip
    run = auto or gpu
    if run is None:
        out.append(check("stall ratio, pipeline on", None, "no served run on the device"))
    else:
        moved = run.get("rotations_out") or 0
        out.append(check("stall ratio, pipeline on", run["stall_ratio"] is not None and moved > 0,
                         f"{run['stall_ratio'] if run['stall_ratio'] is None else round(run['stall_ratio'], 4)} over {run['steps']} steps ({run['dtype']}, {moved} rotations out; "
                         f"transfer {ms(run['transfer_ms_median'])} ms, compute {ms(run['compute_ms_median'])} ms median)"))  # fmt: skip
    if auto is not None and cpu is not None:
        same = sum(a == b for a, b in zip(cpu["texts"], auto["texts"]))
        out.append(check("served bfloat16 vs cpu float32 (information)", True, f"{same}/{len(cpu['texts'])} identical"))
    return out


def report(args: argparse.Namespace) -> int:
    work, dest = args.work, args.dest
    summary = load(work / "stages.json") or {}
    pytest_line = (work / "pytest.line").read_text().strip() if (work / "pytest.line").exists() else ""
    rows = [check("pytest -m gpu", summary.get("pytest_rc") == 0, pytest_line or "no result")]
    kv_runs = {name: load(work / f"kv_{name}.json") for name in summary.get("kv_runs", [])}
    for name, kv in kv_runs.items():
        rows += transfer_checks(kv, name, args.dry_run)
    served = {k: load(work / f"served_{k}.json") for k in ("cpu", "cuda", "cuda_auto")}
    rows += served_checks(served)
    for stage, rc in summary.get("stage_rc", {}).items():
        if rc != 0:
            rows.append(check(f"stage {stage}", False, f"exit status {rc}"))
    failed = [r for r in rows if r["status"] in ("FAIL", "missing")]
    body = {"ok": not failed, "summary": summary, "checks": rows, "kv": kv_runs, "served": served}
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "gpu_check.json").write_text(json.dumps(body, indent=2) + "\n")
    lines = [
        f"## GPU check: {'all passed' if not failed else f'{len(failed)} of {len(rows)} checks not passed'}",
        "",
        f"{summary.get('device', '?')}; install {summary.get('install_s', '?')} s, checks {summary.get('checks_s', '?')} s",
        "",
        "| check | status | detail |",
        "| --- | --- | --- |",
        *[f"| {r['check']} | {r['status']} | {r['detail']} |" for r in rows],
        "",
        "| KV run | mode | copy | both GB/s | h2d GB/s | d2h GB/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, kv in kv_runs.items():
        if kv is None:
            continue
        p = kv.get("pinned") or {}
        ceiling = "pinned copy" if p else "host memcpy"
        lines.append(f"| {name} | {ceiling} | contiguous | {p.get('duplex_gbps', kv.get('memcpy_gbps'))} | "
                     f"{p.get('h2d_gbps', '')} | {p.get('d2h_gbps', '')} |")  # fmt: skip
        for mode, m in kv["modes"].items():
            lines.append(f"| {name} | {mode} | {m['copy_impl']} | {m['effective_gbps']} | "
                         f"{m.get('h2d_gbps', '')} | {m.get('d2h_gbps', '')} |")  # fmt: skip
    (dest / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if not failed else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.gpu_check", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("served")
    s.add_argument("--device", default="cuda")
    s.add_argument("--dtype", default="auto")
    s.add_argument("--json", type=Path, required=True)
    r = sub.add_parser("report")
    r.add_argument("work", type=Path, help="where the stages left their JSON")
    r.add_argument("--dest", type=Path, required=True, help="where gpu_check.json and gpu_check.md go")
    r.add_argument("--dry-run", action="store_true", help="CPU dry run: transfer goals are figures, not checks")
    args = parser.parse_args(argv)
    return served(args) if args.cmd == "served" else report(args)


if __name__ == "__main__":
    sys.exit(main())
