"""`superinfer bench serve`: replay a workload against a live OpenAI-compatible server.

Each request is sent at its arrival time as a streaming `/v1/completions` call (temperature
0, `max_tokens` = the item's output length, `ignore_eos` so the length is the item's, on
servers that honour it). The client timestamps every streamed chunk: TTFT is the first
chunk's delay from the send, TBT every gap after it, as vLLM's benchmark and the paper's
client measure them. `--max-concurrency` holds requests back in the client (TTFT is then
timed from the actual send, as vLLM does; `start_s - arrival_s` in each record shows the
hold). Metrics come from `bench.report.summarize`, shared with the simulator.

Multi-turn (`--multi-turn`, workload.py): a conversation's turns are sent one after the
other, each prompt the system prompt, every earlier user turn and the text the server
streamed back for it, then the new user turn; the next turn goes `--think-time` after
the previous one's last chunk. A turn that fails ends its conversation (the turns after
it are recorded as not sent). The server's `usage.prompt_tokens_details.cached_tokens`
gives each request's cached tokens, summed into the cached-token share.

Prompts are counted with the served model's tokenizer: the `root` GET /v1/models gives (the
model's path on the server, as vLLM gives it) when that path exists on this machine, else
the bundled model's, said on stderr; `--tokenizer` chooses one outright. `--json` writes our
summary and records, or with `--result-format vllm` the keys vLLM's serving benchmark writes
(bench/report/vllm_result.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import aiohttp

from bench.live.workload import SyntheticSpec, WorkItem, add_chat_arguments, chat_spec, load_workload
from bench.report.metrics import RequestRecord, format_summary, plot_cdfs, summarize
from bench.report.vllm_result import vllm_result
from services.scheduler.core import SchedulerConfig

DONE = object()  # the `data: [DONE]` sentinel
HUNG_UP = "the client hung up"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default %(default)s)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument(
        "--tokenizer", default=None,
        help="GGUF or model directory to count tokens with (default: the served model's, where GET /v1/models "
        "gives a root that exists here; else the bundled model's)",
    )  # fmt: skip
    p.add_argument("--dataset", default="sharegpt", help="sharegpt, sharegpt-long, synthetic, or a JSONL trace path")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--rate", type=float, default=math.inf, help="requests/s; inf sends all at once (default)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ttft-slo", type=float, default=SchedulerConfig.ttft_slo, help="S_F in seconds (default %(default)s)"
    )
    p.add_argument(
        "--tbt-slo", type=float, default=SchedulerConfig.tbt_slo, help="S_B in seconds (default %(default)s)"
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    add_sampling_argument(p)
    p.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds per request")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument(
        "--result-format", choices=["superinfer", "vllm"], default="superinfer",
        help="--json's keys: ours (summary, config, records) or those vLLM's serving benchmark writes",
    )  # fmt: skip
    p.add_argument("--plots", type=Path, default=None, help="write TTFT/TBT CDF PNGs into this folder")
    add_chat_arguments(p)
    g = p.add_argument_group("synthetic dataset")
    g.add_argument("--input-len", type=int, default=128, help="mean prompt tokens")
    g.add_argument("--output-len", type=int, default=64, help="mean output tokens")
    g.add_argument("--length-dist", choices=["fixed", "uniform", "lognormal"], default="uniform")
    g.add_argument("--length-spread", type=float, default=0.5, help="uniform: range ratio; lognormal: sigma")


def run(args: argparse.Namespace) -> int:
    tokenizer = tokenizer_path(args.tokenizer, args.base_url, args.api_key, args.model)
    items = workload_from_args(args, tokenizer)
    model = args.model or first_model(args.base_url, args.api_key)
    print(describe_workload(items, args.dataset), file=sys.stderr)
    records, duration_s = asyncio.run(replay(args.base_url, model, items, args))
    summary = summarize(records, args.ttft_slo, args.tbt_slo, duration_s)
    print(format_summary(summary))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        if args.result_format == "vllm":
            body = vllm_result(records, summary, vllm_meta(args, model, tokenizer))
        else:
            config = {**run_config(args, model), "tokenizer_path": str(tokenizer)}
            body = {**summary, "config": config, "requests": [asdict(r) for r in records]}
        args.json.write_text(json.dumps(body, indent=1))
    if args.plots:
        plot_cdfs(records, args.ttft_slo, args.tbt_slo, args.plots)
    return 0 if summary["completed"] else 1


def workload_from_args(args: argparse.Namespace, tokenizer_file: Path | None = None) -> list[WorkItem]:
    """The items, counted with `tokenizer_file` (default: `--tokenizer`, else the bundled model)."""
    from shared.tokenizer import load_tokenizer
    from shared.modelfile import resolve_model_path

    tokenizer = load_tokenizer(tokenizer_file or resolve_model_path(args.tokenizer))
    spec = SyntheticSpec(args.input_len, args.output_len, args.length_dist, args.length_spread)
    return load_workload(
        args.dataset, args.num_requests, args.rate, tokenizer, args.burstiness, args.seed, spec, chat_spec(args)
    )


def describe_workload(items: list[WorkItem], dataset: str) -> str:
    n = max(len(items), 1)
    mean_in = sum(i.prompt_tokens for i in items) / n
    mean_out = sum(i.output_tokens for i in items) / n
    last = items[-1].arrival_s if items else 0.0
    return (
        f"workload: {len(items)} requests from {dataset}"
        + (f" in {len({i.conversation for i in items})} conversations" if items and items[0].conversation >= 0 else "")
        + f", mean {mean_in:.0f} prompt / "
        f"{mean_out:.0f} output tokens, last arrival {last:.1f} s"
    )


def run_config(args: argparse.Namespace, model: str) -> dict:
    cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if not callable(v)}
    cfg.pop("api_key", None)
    cfg["rate"] = str(args.rate) if math.isinf(args.rate) else args.rate  # JSON has no inf
    return {**cfg, "model": model}


def vllm_meta(args: argparse.Namespace, model: str, tokenizer: Path) -> dict:
    """The run keys vLLM's result file starts with (`backend`: its name for a streamed
    /v1/completions client)."""
    return {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "backend": "openai",
        "model_id": model,
        "tokenizer_id": str(tokenizer),
        "num_prompts": args.num_requests,
        "request_rate": "inf" if math.isinf(args.rate) else args.rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
    }


def served_models(base_url: str, api_key: str | None) -> list[dict]:
    """GET /v1/models' cards."""
    import urllib.request

    req = urllib.request.Request(base_url.rstrip("/") + "/v1/models", headers=auth_headers(api_key))
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())["data"]


def first_model(base_url: str, api_key: str | None) -> str:
    return served_models(base_url, api_key)[0]["id"]


def served_root(base_url: str, api_key: str | None, model: str | None) -> str | None:
    """The `root` of `model`'s card in GET /v1/models (the first card's without a model)."""
    cards = served_models(base_url, api_key)
    card = next((c for c in cards if c.get("id") == model), cards[0] if cards else {})
    return card.get("root")


def tokenizer_path(explicit: str | None, base_url: str, api_key: str | None, model: str | None) -> Path:
    """`explicit` (--tokenizer) when given; else the served model's `root` when that path
    holds a model on this machine; else the bundled model, with one line on stderr saying why."""
    from shared.modelfile import resolve_model_path

    if explicit:
        return resolve_model_path(explicit)
    try:
        root = served_root(base_url, api_key, model)
    except (OSError, ValueError, LookupError, TypeError, AttributeError) as e:  # no answer, or not a model list
        root, reason = None, f"GET /v1/models failed: {e}"
    else:
        reason = "the server gives no model root" if root is None else f"its root {root} is no model on this machine"
    if root is not None and Path(root).exists():
        with contextlib.suppress(ValueError):  # a folder without config.json
            return resolve_model_path(root)
    print(f"tokenizer: the bundled model's ({reason}); --tokenizer chooses another", file=sys.stderr)
    return resolve_model_path(None)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# ---------------------------------------------------------------- the replay


async def replay(base_url: str, model: str, items: list[WorkItem], args) -> tuple[list[RequestRecord], float]:
    """Send every item at its arrival time; return the records (in workload order) and
    the run's duration, from the first arrival to the last response."""
    url = base_url.rstrip("/") + "/v1/completions"
    limit = asyncio.Semaphore(args.max_concurrency or len(items) or 1)
    progress = Progress(len(items))
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=auth_headers(args.api_key)) as s:
        t0 = time.perf_counter()

        async def one(item: WorkItem) -> RequestRecord:
            await asyncio.sleep(max(0.0, t0 + item.arrival_s - time.perf_counter()))
            async with limit:
                record = await send(s, url, request_body(model, item, args.ignore_eos, args.sampling), item, t0)
            progress.update(record.ok)
            return record

        async def conversation(turns: list[WorkItem]) -> list[RequestRecord]:
            await asyncio.sleep(max(0.0, t0 + turns[0].arrival_s - time.perf_counter()))
            history, records = "", []
            for k, item in enumerate(turns):
                if k:
                    await asyncio.sleep(item.think_s)
                prompt = history + item.prompt
                due = time.perf_counter() - t0
                texts: list[str] = []
                async with limit:
                    body = request_body(model, replace(item, prompt=prompt, arrival_s=due), args.ignore_eos, args.sampling)
                    record = await send(s, url, body, replace(item, arrival_s=due), t0, texts)
                progress.update(record.ok)
                records.append(record)
                if not record.ok:
                    records += [RequestRecord(ok=False, error="an earlier turn failed") for _ in turns[k + 1 :]]
                    break
                history = prompt + "".join(texts)
            return records

        if items and items[0].conversation >= 0:
            by_conv: dict[int, list[WorkItem]] = {}
            for item in items:
                by_conv.setdefault(item.conversation, []).append(item)
            convs = await asyncio.gather(*(conversation(turns) for turns in by_conv.values()))
            records = [r for c in convs for r in c]
        else:
            records = await asyncio.gather(*(one(item) for item in items))
        duration_s = time.perf_counter() - t0
    progress.close()
    return list(records), duration_s


def add_sampling_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sampling", type=sampling_fields, default={}, metavar="JSON",
        help='sampling fields every request carries instead of greedy decoding, e.g. \'{"temperature": 0.8, '
        '"top_p": 0.95}\' (default: temperature 0)',
    )  # fmt: skip


def sampling_fields(text: str) -> dict:
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(fields, dict):
        raise argparse.ArgumentTypeError("a JSON object of request fields, e.g. {\"temperature\": 0.8}")
    return fields


def client_args(request_timeout: float, api_key: str | None = None, sampling: dict | None = None) -> argparse.Namespace:
    """What `replay` reads, for a caller without `bench serve`'s arguments: every request sent at
    its arrival, EOS ignored, greedy unless `sampling` (request fields) says otherwise."""
    return argparse.Namespace(
        max_concurrency=None, request_timeout=request_timeout, api_key=api_key, ignore_eos=True, sampling=sampling or {}
    )


def request_body(model: str, item: WorkItem, ignore_eos: bool, sampling: dict | None = None) -> dict:
    body = {
        "model": model,
        "prompt": item.prompt,
        "max_tokens": item.output_tokens,
        "temperature": 0.0,
        **(sampling or {}),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return {**body, "ignore_eos": True} if ignore_eos else body


async def send(
    session: aiohttp.ClientSession, url: str, body: dict, item: WorkItem, t0: float, texts: list[str] | None = None
) -> RequestRecord:
    """One streamed completion, timed chunk by chunk; `texts` collects the streamed text.
    Never raises: a failure is a record."""
    start = time.perf_counter()
    record = RequestRecord(
        ok=False,
        prompt_tokens=item.prompt_tokens,
        expected_output_tokens=item.output_tokens,
        arrival_s=item.arrival_s,
        start_s=start - t0,
    )
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {error_message(await resp.text())}"
                return record
            await read_stream(resp, record, start, texts=texts)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        record.error = f"{type(e).__name__}: {e}"[:160]
    return record


async def read_stream(
    resp: aiohttp.ClientResponse,
    record: RequestRecord,
    start: float,
    hang_up: Callable[[dict], bool] | None = None,
    texts: list[str] | None = None,
) -> None:
    """Fill `record` from the SSE stream; `ok` only when it ended with [DONE], no error.
    `hang_up(event)`, when given, sees each event first; True closes the connection there
    (the soak benchmark's deliberate disconnects). `texts`, when given, gets each chunk's text."""
    last, num_chunks, buf = start, 0, b""
    async for data in resp.content.iter_any():
        now = time.perf_counter()
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            event = parse_sse_line(line)
            if event is DONE:
                record.e2e_s = now - start
                record.output_tokens = record.output_tokens or num_chunks
                record.ok = num_chunks > 0
                record.error = None if record.ok else "no tokens streamed"
                return
            if event is None:
                continue
            if hang_up is not None and hang_up(event):
                resp.close()
                record.error = HUNG_UP
                return
            if "error" in event:
                record.error = f"stream error: {error_message(json.dumps(event))}"
                return
            if event.get("choices") and not closes_only(event, num_chunks):
                if num_chunks == 0:
                    record.ttft_s = now - start
                else:
                    record.tbt_s.append(now - last)
                last, num_chunks = now, num_chunks + 1
                if texts is not None:
                    texts.append(event["choices"][0].get("text") or "")
            if usage := event.get("usage"):
                record.output_tokens = usage.get("completion_tokens") or 0
                record.usage_prompt_tokens = usage.get("prompt_tokens")
                if isinstance(details := usage.get("prompt_tokens_details"), dict):
                    record.cached_tokens = details.get("cached_tokens")
    record.error = "stream ended without [DONE]"


def closes_only(event: dict, num_chunks: int) -> bool:
    """A chunk after the first token with no text that only carries a `finish_reason` (as
    llama.cpp's server ends a stream): no token, so no gap is counted for it."""
    choice = event["choices"][0]
    text = choice["text"] if "text" in choice else (choice.get("delta") or {}).get("content")
    return num_chunks > 0 and not text and choice.get("finish_reason") is not None


def parse_sse_line(line: bytes):
    """A `data:` line's JSON, `DONE` for `data: [DONE]`, None for anything else."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return DONE
    try:
        event = json.loads(payload)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def error_message(text: str) -> str:
    """The OpenAI-style `error.message` of a body, else the body itself, shortened."""
    try:
        err = json.loads(text).get("error")
        text = err.get("message", text) if isinstance(err, dict) else str(err or text)
    except (ValueError, AttributeError):
        pass
    return text.strip()[:120]


class Progress:
    """One self-rewriting stderr line: done/total, failures, elapsed; at most 5 updates/s."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.failed = total, 0, 0
        self.t0 = self.shown = time.perf_counter()

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        now = time.perf_counter()
        if now - self.shown >= 0.2 or self.done == self.total:
            self.shown = now
            line = f"\r{self.done}/{self.total} done, {self.failed} failed, {now - self.t0:.1f} s"
            sys.stderr.write(line)
            sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="superinfer bench serve", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
