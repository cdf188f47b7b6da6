"""`superinfer bench compare`: the same workloads against OpenAI-compatible servers, one
server at a time, side by side.

A target is `NAME=URL[,MODEL[,START COMMAND]]`. With a start command the bench runs it in its
own process group, waits until GET /health (or /v1/models, where /health is 404) answers
200 and notes that time to ready, runs the workloads, then kills the group and waits until
the port is free before the next target. Without one the server must be running already;
without a model, the first of its GET /v1/models is sent. Two workloads:

- `probe`, the fixed-length stream probe: at each level N of `--streams`, `--rounds` rounds
  of N concurrent streams, each a `--prompt-len`-token prompt of random one-token words
  (distinct per request, so no prefix cache helps) → `--output-len` tokens with EOS
  ignored; `--warmup` requests go first and are not counted. Per level: TTFT, inter-token
  latency (ITL: the gaps between streamed chunks; `tokens_per_chunk` is 1 where the server
  streamed one token per chunk), output tok/s over the rounds' wall time, and the token
  counts the server reported in its `usage`.
- `sharegpt`: `bench serve`'s ShareGPT replay at `--rate` req/s, with its figures; with
  `--rates`, the pressure comparison instead (`bench.live.pressure`): the trace at every
  rate and burstiness, a row per target and run with the server's preemption counters.

The load generator, the workloads and every figure are `bench serve`'s (`replay`,
`load_workload`/`synthetic_items`, `summarize`). The workloads are built once, when the first
target is ready, with the tokenizer `bench serve` would take against it (`--tokenizer`, else
that target's served model where its `root` exists here, else the bundled model); every
target gets the same requests. `--model PATH` (a larger model, e.g. a `bench synth-model` folder)
takes the place of `{model}` in every target's start command and model name, builds the prompts
unless `--tokenizer` says otherwise, and its shape is recorded with the run. Writes
`compare_<timestamp>.json` and the Markdown table beside it as `.md` under `--out-dir`, and
prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.live import pressure
from bench.live.serve import add_sampling_argument, first_model, replay, tokenizer_path
from bench.live.serve import client_args as serve_client_args
from bench.live.server import REPO, Launched, LaunchError, answers_ready, launch
from bench.live.workload import SyntheticSpec, WorkItem, add_chat_arguments, chat_spec, load_workload, synthetic_items
from bench.report.metrics import RequestRecord, format_summary, summarize
from bench.report.rows import dig
from services.scheduler.core import SchedulerConfig

WORKLOADS = ("probe", "sharegpt")


@dataclass(frozen=True)
class Target:
    name: str
    base_url: str
    model: str | None = None  # None: the first of GET /v1/models
    start: str | None = None  # a shell command line; None: already running


def parse_target(text: str) -> Target:
    """`NAME=URL[,MODEL[,START COMMAND]]`; the start command is the rest, commas and all."""
    name, sep, rest = text.partition("=")
    url, model, start = (rest.split(",", 2) + ["", ""])[:3]
    if not sep or not name.strip() or not url.strip().startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=URL[,MODEL[,START COMMAND]], URL http(s)://...")
    return Target(name.strip(), url.strip().rstrip("/"), model.strip() or None, start.strip() or None)


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return values


def workload_list(text: str) -> list[str]:
    names = [w.strip() for w in text.split(",") if w.strip()]
    if unknown := set(names) - set(WORKLOADS):
        raise argparse.ArgumentTypeError(f"unknown workload(s) {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target", type=parse_target, action="append", required=True, metavar="NAME=URL[,MODEL[,START]]",
        help="a server to measure, repeatable, run in the order given; START is a shell command line "
        "that starts it (it runs in its own process group and is killed afterwards)",
    )  # fmt: skip
    p.add_argument("--workloads", type=workload_list, default=list(WORKLOADS), help="probe,sharegpt (default both)")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds a start command has to get ready")
    p.add_argument("--stop-timeout", type=float, default=30.0, help="SIGTERM to SIGKILL, s")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")
    p.add_argument("--api-key", default=None, help="sent to every target as 'Authorization: Bearer KEY'")
    p.add_argument(
        "--tokenizer", default=None,
        help="GGUF or model directory building the prompts (default: the first ready target's served model, "
        "where its GET /v1/models root exists here; else the bundled model)",
    )  # fmt: skip
    p.add_argument(
        "--model", type=Path, default=None,
        help="a model folder or file written for {model} in the targets' start commands and names (default: none)",
    )  # fmt: skip
    add_sampling_argument(p)
    p.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results", help="default %(default)s")
    p.add_argument("--log-dir", type=Path, default=None, help="start commands' output (default: a new temp folder)")
    g = p.add_argument_group("stream probe")
    g.add_argument("--streams", type=int_list, default=[1, 8, 16], help="concurrency levels (default 1,8,16)")
    g.add_argument("--rounds", type=int, default=2, help="rounds per level (default %(default)s)")
    g.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (default %(default)s)")
    g.add_argument("--output-len", type=int, default=128, help="output tokens, EOS ignored (default %(default)s)")
    g.add_argument("--warmup", type=int, default=1, help="requests sent first, not counted (default %(default)s)")
    g = p.add_argument_group("ShareGPT run")
    g.add_argument("--num-requests", type=int, default=60)
    g.add_argument("--rate", type=float, default=1.0, help="requests/s (default %(default)s)")
    g.add_argument(
        "--burstiness", type=pressure.float_list, default=[1.0],
        help="gamma shape of arrival gaps; 1 = Poisson; with --rates, several: every rate at each",
    )  # fmt: skip
    g.add_argument("--seed", type=int, default=0, help="also seeds the probe's prompts")
    g.add_argument(
        "--ttft-slo", type=float, default=SchedulerConfig.ttft_slo, help="S_F in seconds (default %(default)s)"
    )
    g.add_argument(
        "--tbt-slo", type=float, default=SchedulerConfig.tbt_slo, help="S_B in seconds (default %(default)s)"
    )
    pressure.add_arguments(g)
    add_chat_arguments(p)


def usage_error(args: argparse.Namespace) -> str | None:
    names = {t.name for t in args.target}
    if len(names) < len(args.target):
        return "target names must differ"
    if args.rates is None and (len(args.burstiness) > 1 or args.metrics or args.restart_per_run):
        return "several --burstiness values, --metrics and --restart-per-run go with --rates"
    if args.rates is not None and "sharegpt" not in args.workloads:
        return "--rates runs the sharegpt workload: add it to --workloads"
    if unknown := {n for n, _ in args.metrics} - names:
        return f"--metrics for no target: {', '.join(sorted(unknown))}"
    if args.model is None and any("{model}" in f"{t.start}{t.model}" for t in args.target):
        return "a target names {model}: give --model PATH"
    if args.model is not None and not args.model.exists():
        return f"--model {args.model}: no such file or folder"
    return None


def with_model(t: Target, model: Path | None) -> Target:
    """`t` with `{model}` in its start command and model name replaced by `model`."""
    if model is None:
        return t
    fill = lambda v: None if v is None else v.replace("{model}", str(model))  # noqa: E731
    return Target(t.name, t.base_url, fill(t.model), fill(t.start))


def model_shape(path: Path | None) -> dict | None:
    """What a reader needs to place the run: the served model's architecture (GGUFs of a
    `synth-model` folder all have one; the first file with a config is read)."""
    from shared.modelfile import read_model_config

    if path is None:
        return None
    files = [path] if path.is_file() or (path / "config.json").is_file() else sorted(path.glob("*.gguf"))
    if not files:
        return {"path": str(path)}
    cfg = read_model_config(files[0])
    keys = ("name", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")
    return {"path": str(path), **{k: getattr(cfg, k) for k in keys}}


def run(args: argparse.Namespace) -> int:
    if error := usage_error(args):
        print(f"bench compare: {error}", file=sys.stderr)
        return 2
    built: list[Workloads] = []  # by the first target that is ready

    args.target = [with_model(t, args.model) for t in args.target]
    tokenizer = args.tokenizer or (_tokenizer_of(args.model) if args.model is not None else None)

    def workloads(base_url: str, model: str) -> Workloads:
        if not built:
            built.append(build_workloads(args, tokenizer_path(tokenizer, base_url, args.api_key, model)))
        return built[0]

    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="superinfer-compare-"))
    results = [run_target(t, workloads, args, log_dir / f"{stamp}-{t.name}.log") for t in args.target]
    body = {"created": stamp, "config": run_config(args), "model": model_shape(args.model), "targets": results}
    body["tokenizer_path"] = str(built[0].tokenizer_path) if built else None
    table = markdown(body)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / f"compare_{stamp}.json"
    json_path.write_text(json.dumps(body, indent=1))
    json_path.with_suffix(".md").write_text(table + "\n")
    print(table)
    print(f"wrote {json_path} and {json_path.with_suffix('.md').name}", file=sys.stderr)
    return 0 if all(target_ok(r) for r in results) else 1


def _tokenizer_of(model: Path) -> str:
    """A file or folder of `model` that holds the tokenizer: itself, or a GGUF in it."""
    if model.is_file() or (model / "config.json").is_file():
        return str(model)
    ggufs = sorted(model.glob("*.gguf"))
    return str(ggufs[0]) if ggufs else str(model)


def run_config(args: argparse.Namespace) -> dict:
    cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if not callable(v)}
    cfg.pop("api_key", None)
    cfg["target"] = [asdict(t) for t in args.target]
    cfg["rate"] = str(args.rate) if math.isinf(args.rate) else args.rate  # JSON has no inf
    if args.rates is None:  # as before --rates: one run, these keys unknown
        cfg["burstiness"] = args.burstiness[0]
        for key in ("rates", "metrics", "restart_per_run"):
            del cfg[key]
    else:
        del cfg["rate"]
        cfg["metrics"] = [list(m) for m in args.metrics]
    return cfg


def target_ok(result: dict) -> bool:
    runs = [*result.get("probe", {}).values(), *([result["sharegpt"]] if "sharegpt" in result else [])]
    runs += result.get("runs", [])
    stops = [result.get("stopped", {})] + [r.get("stopped_before", {}) for r in result.get("runs", [])]
    return result["error"] is None and all(r["failed"] == 0 for r in runs) and all(
        s.get("group_gone", True) for s in stops
    )


@dataclass(frozen=True)
class Workloads:
    """What every target is sent; `sweep`: (rate, burstiness, items) of every `--rates` run."""

    tokenizer_path: Path
    probe: ProbeWorkload | None
    rated: list[WorkItem] | None
    sweep: list[tuple[float, float, list[WorkItem]]] | None


def build_workloads(args, tokenizer_file: Path) -> Workloads:
    from shared.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_file)
    probe = probe_workload(args, tokenizer) if "probe" in args.workloads else None
    rated = sweep = None
    if args.rates is not None:
        sweep = [
            (rate, b, load_workload("sharegpt", args.num_requests, rate, tokenizer, b, args.seed, chat=chat_spec(args)))
            for rate, b in pressure.runs_of(args)
        ]  # fmt: skip
    elif "sharegpt" in args.workloads:
        rated = load_workload(
            "sharegpt", args.num_requests, args.rate, tokenizer, args.burstiness[0], args.seed, chat=chat_spec(args)
        )
    return Workloads(tokenizer_file, probe, rated, sweep)


# ---------------------------------------------------------------- one target


def run_target(t: Target, workloads: Callable[[str, str], Workloads], args, log_path: Path) -> dict:
    """Start (if asked), measure, stop. A target that cannot start is a result with an error.
    `workloads(base_url, model)`: the requests to send, built by the first ready target."""
    out: dict = {"name": t.name, "base_url": t.base_url, "model": t.model, "start": t.start, "error": None}
    print(f"== {t.name} at {t.base_url}" + (f": {t.start}" if t.start else ""), file=sys.stderr)
    server = None
    try:
        if t.start:
            server = launch(t.start, t.base_url, log_path)
            wait_ready(t, server, out, args)
        elif not answers_ready(t.base_url):
            raise LaunchError(f"nothing ready at {t.base_url}: start it first, or give a start command")
        model = out["model"] = t.model or first_model(t.base_url, args.api_key)
        work = workloads(t.base_url, model)
        if work.probe is not None:
            out["probe"] = run_probe(t.name, t.base_url, model, work.probe, args)
        if work.rated is not None:
            out["sharegpt"] = run_rated(t.name, t.base_url, model, work.rated, args)
        for i, (rate, burstiness, items) in enumerate(work.sweep or []):
            run = out.setdefault("runs", [])
            fresh: dict = {}
            if i and server is not None and args.restart_per_run:
                fresh["stopped_before"], server = server.stop(args.stop_timeout), None
                server = launch(t.start, t.base_url, log_path.with_name(f"{log_path.stem}-run{i + 1}.log"))
                wait_ready(t, server, fresh, args)
            replay_run = lambda: replay_items(t.base_url, model, items, args)  # noqa: E731
            run.append({**fresh, **pressure.run(t.name, t.base_url, rate, burstiness, replay_run, args)})
    except (LaunchError, OSError, ValueError, KeyError) as e:
        out["error"] = f"{type(e).__name__}: {e}" if not isinstance(e, LaunchError) else str(e)
        print(f"{t.name}: {out['error']}", file=sys.stderr)
    finally:
        if server is not None:
            out["stopped"] = server.stop(args.stop_timeout)
    return out


def wait_ready(t: Target, server: Launched, record: dict, args) -> None:
    record.update(pgid=server.pgid, log=str(server.log_path))
    record["ready_s"] = server.wait_ready(args.ready_timeout)
    print(f"{t.name}: ready after {server.ready_s:.1f} s", file=sys.stderr)


def client_args(args) -> argparse.Namespace:
    return serve_client_args(args.request_timeout, args.api_key, args.sampling)


def replay_items(base_url: str, model: str, items: list[WorkItem], args) -> tuple[list[RequestRecord], float]:
    return asyncio.run(replay(base_url, model, items, client_args(args)))


# ---------------------------------------------------------------- the stream probe


@dataclass
class ProbeWorkload:
    warmup: list[WorkItem]
    levels: dict[int, list[list[WorkItem]]]  # streams -> its rounds, each N items sent at once


def probe_workload(args, tokenizer) -> ProbeWorkload:
    """Every request of every round its own random prompt (one seeded draw, sliced)."""
    spec = SyntheticSpec(args.prompt_len, args.output_len, "fixed", 0.0)
    total = args.warmup + sum(args.streams) * args.rounds
    items = iter(synthetic_items(spec, total, tokenizer, args.seed))
    warmup = [next(items) for _ in range(args.warmup)]
    levels = {n: [[next(items) for _ in range(n)] for _ in range(args.rounds)] for n in args.streams}
    return ProbeWorkload(warmup, levels)


def run_probe(name: str, base_url: str, model: str, probe: ProbeWorkload, args) -> dict:
    if probe.warmup:
        print(f"{name}: warm-up", file=sys.stderr)
        replay_items(base_url, model, probe.warmup, args)
    out = {}
    for n, rounds in probe.levels.items():
        records, durations, round_tok_s = [], [], []
        for i, items in enumerate(rounds):
            print(f"{name}: {n} streams, round {i + 1}/{len(rounds)}", file=sys.stderr)
            recs, duration_s = replay_items(base_url, model, items, args)
            records += recs
            durations.append(duration_s)
            round_tok_s.append(summarize(recs, args.ttft_slo, args.tbt_slo, duration_s)["output_tok_s"])
        summary = summarize(records, args.ttft_slo, args.tbt_slo, sum(durations))
        out[str(n)] = {
            **summary,
            **token_counts(records),
            "round_output_tok_s": round_tok_s,
            "requests": [asdict(r) for r in records],
        }
    return out


def token_counts(records: list[RequestRecord]) -> dict:
    """[min, max] of what was sent and what the server counted; tokens per streamed chunk."""
    done = [r for r in records if r.ok]
    span = lambda xs: [min(xs), max(xs)] if xs else None  # noqa: E731
    chunks = sum(len(r.tbt_s) + 1 for r in done)
    return {
        "prompt_tokens_sent": span([r.prompt_tokens for r in done]),
        "prompt_tokens_usage": span([r.usage_prompt_tokens for r in done if r.usage_prompt_tokens is not None]),
        "output_tokens": span([r.output_tokens for r in done]),
        "tokens_per_chunk": sum(r.output_tokens for r in done) / chunks if chunks else None,
    }


# ---------------------------------------------------------------- the rated run


def run_rated(name: str, base_url: str, model: str, items: list[WorkItem], args) -> dict:
    print(f"{name}: ShareGPT, {len(items)} requests at {args.rate:g} req/s", file=sys.stderr)
    records, duration_s = replay_items(base_url, model, items, args)
    summary = summarize(records, args.ttft_slo, args.tbt_slo, duration_s)
    print(format_summary(summary), file=sys.stderr)
    return {**summary, "requests": [asdict(r) for r in records]}


# ---------------------------------------------------------------- the table


def table_rows(cfg: dict) -> list[tuple[str, str, tuple[str, ...], str]]:
    """(workload, metric, path of the value in a target's result, kind) for every row."""
    rows = [("server", "time to ready (s)", ("ready_s",), "s")]
    if "probe" in cfg["workloads"]:
        for n in cfg["streams"]:
            label = f"{n} stream{'s' * (n > 1)}, {cfg['prompt_len']} → {cfg['output_len']} tokens"
            level = ("probe", str(n))
            rows += [
                (label, "TTFT p50 (ms)", (*level, "ttft_p50_ms"), "ms"),
                (label, "ITL p50 (ms)", (*level, "tbt_p50_ms"), "ms"),
                (label, "ITL p90 (ms)", (*level, "tbt_p90_ms"), "ms"),
                (label, "output tok/s", (*level, "output_tok_s"), "rate"),
                (label, "prompt tokens (usage)", (*level, "prompt_tokens_usage"), "span"),
                (label, "output tokens per stream", (*level, "output_tokens"), "span"),
            ]  # fmt: skip
    if "sharegpt" in cfg["workloads"] and cfg.get("rates") is None:
        rate = f"{cfg['rate']:g}" if isinstance(cfg["rate"], float) else cfg["rate"]  # "inf" in JSON
        label = f"ShareGPT, {cfg['num_requests']} requests at {rate} req/s, seed {cfg['seed']}"
        rows += [
            (label, f"TTFT ≤ {cfg['ttft_slo']:g} s", ("sharegpt", "ttft_attainment"), "pct"),
            (label, f"TBT gaps ≤ {cfg['tbt_slo'] * 1000:g} ms", ("sharegpt", "tbt_attainment"), "pct"),
            (label, "TTFT p50 (ms)", ("sharegpt", "ttft_p50_ms"), "ms"),
            (label, "TBT p50 (ms)", ("sharegpt", "tbt_p50_ms"), "ms"),
            (label, "TPOT p50 (ms)", ("sharegpt", "tpot_p50_ms"), "ms"),
            (label, "output tok/s", ("sharegpt", "output_tok_s"), "rate"),
            (label, "e2e p50 (s)", ("sharegpt", "e2e_p50_ms"), "ms_as_s"),
            (label, "completed / failed", ("sharegpt",), "counts"),
        ]
    return rows


def cell(v, kind: str) -> str:
    if v is None:
        return "—"
    if kind == "pct":
        return f"{100 * v:.1f}%"
    if kind == "span":
        return f"{v[0]}" if v[0] == v[1] else f"{v[0]}–{v[1]}"
    if kind == "counts":
        return f"{v['completed']} / {v['failed']}"
    if kind == "ms_as_s":
        return f"{v / 1000:.2f}"
    return f"{v:.2f}" if kind == "s" else f"{v:.1f}"


def versus(first, second, kind: str) -> str:
    """The second target against the first: points for a share, a ratio for a number."""
    if first is None or second is None or kind in ("span", "counts"):
        return ""
    if kind == "pct":
        return f"{100 * (second - first):+.1f} pts"
    return f"{second / first:.2f}×" if first else ""


def markdown(body: dict) -> str:
    """The side by side table (with `--rates`, where it has rows: time to ready, the probe),
    then the pressure table, then the targets that failed."""
    rates, table = body["config"].get("rates"), side_by_side(body)
    parts = [table] if rates is None or table.count("\n") > 1 else []
    if rates is not None:
        parts.append(pressure.markdown(body, cell))
    parts += [f"**{t['name']}** failed: {t['error'].splitlines()[0]}" for t in body["targets"] if t["error"]]
    return "\n\n".join(parts)


def side_by_side(body: dict) -> str:
    targets, cfg = body["targets"], body["config"]
    names = [t["name"] for t in targets]
    header = ["workload", "metric", *names] + ([f"{names[1]} vs {names[0]}"] if len(targets) > 1 else [])
    lines = ["| " + " | ".join(header) + " |", "| --- | --- |" + " ---: |" * (len(header) - 2)]
    last_label = None
    for label, metric, path, kind in table_rows(cfg):
        values = [dig(t, path) for t in targets]
        if label == "server" and all(v is None for v in values):
            continue
        cells = [cell(v, kind) for v in values]
        if len(targets) > 1:
            cells.append(versus(values[0], values[1], kind))
        lines.append("| " + " | ".join([label if label != last_label else "", metric, *cells]) + " |")
        last_label = label
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="superinfer bench compare", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
