"""The operator's commands, spoken to a scheduler's admin socket (ZeroMQ):

    superinfer queues [--state rotary] [--sort vlt] [--json]   one row per live request
    superinfer top [--interval 1]                              the same, live, with a header
    superinfer stats [--json]                                  one-shot summary
    superinfer abort REQUEST_ID                                needs the admin token
    superinfer drain [--undo] [--wait]                         needs the admin token

`--admin ADDR` (or SUPERINFER_ADMIN) picks the scheduler, default tcp://127.0.0.1:5559, where
`superinfer serve` and `superinfer scheduler` put it; the token comes from --admin-token
or SUPERINFER_ADMIN_TOKEN. A scheduler started with `--zmq-keys DIR` answers only clients
with the same keys (`--zmq-keys DIR` or SUPERINFER_ZMQ_KEYS here too), and an address off
loopback needs them. Rendering is plain text and ANSI escapes (no curses).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import msgspec

from shared import protocol as p
from shared import zmqsec
from shared.config import ADMIN_ADDR_ENV, ADMIN_TOKEN_ENV, DEFAULT_ADMIN_ADDR

COMMANDS = ("queues", "top", "stats", "abort", "drain")
STATES = ("waiting", "running", "rotary")
# --sort key -> (row value, largest first)
SORT_KEYS = {
    "vlt": (lambda r: r.vlt, True),
    "age": (lambda r: r.age_s, True),
    "id": (lambda r: r.request_id, False),
    "state": (lambda r: STATES.index(r.state) if r.state in STATES else len(STATES), False),
    "ttft_slack": (lambda r: _none_last(r.ttft_slack_s), False),
    "tbt_slack": (lambda r: _none_last(r.tbt_slack_s), False),
    "output": (lambda r: r.num_output_tokens, True),
    "hbm": (lambda r: r.num_hbm_blocks, True),
    "dram": (lambda r: r.num_dram_blocks, True),
}
_CLEAR_TO_EOL, _CLEAR_BELOW, _HOME = "\x1b[K", "\x1b[J", "\x1b[H"
_ENTER_SCREEN, _LEAVE_SCREEN = "\x1b[?1049h\x1b[?25l", "\x1b[?25h\x1b[?1049l"


class AdminFailure(Exception):
    """The scheduler refused, or did not answer."""


def _none_last(v: float | None) -> float:
    return float("inf") if v is None else v


# ---------------------------------------------------------------- the client


class AdminClient:
    def __init__(self, addr: str, timeout_s: float, zmq_keys: str | None = None) -> None:
        import zmq  # here: `superinfer --help` need not load it

        self.addr, self.timeout_s = addr, timeout_s
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        zmqsec.Curve(self.ctx, zmq_keys).secure_client(self.sock, addr)
        self.sock.connect(addr)

    def ask(self, msg: p.AdminRequest) -> p.AdminReply:
        self.sock.send(p.encode(msg))
        if not self.sock.poll(int(self.timeout_s * 1000)):
            where = f"{self.addr} within {self.timeout_s:g} s"
            raise AdminFailure(f"no answer from {where} (is a scheduler's admin endpoint there?)")
        try:
            reply = p.admin_reply_decoder.decode(self.sock.recv_multipart()[-1])
        except msgspec.DecodeError as e:
            raise AdminFailure(f"unreadable reply from {self.addr}: {e}") from None
        if isinstance(reply, p.AdminError):
            raise AdminFailure(f"{reply.type}: {reply.message}")
        return reply

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


# ---------------------------------------------------------------- pure formatting


def as_dict(obj):
    """Wire structs (msgpack arrays) as JSON objects, recursively."""
    if isinstance(obj, msgspec.Struct):
        return {f: as_dict(getattr(obj, f)) for f in obj.__struct_fields__}
    if isinstance(obj, list):
        return [as_dict(v) for v in obj]
    return obj


def secs(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f}ms" if abs(v) < 1.0 else f"{v:.2f}s" if abs(v) < 100 else f"{v:.0f}s"


def pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def select_rows(rows: list[p.RequestRow], states: list[str] | None, sort: str) -> list[p.RequestRow]:
    """Filter by state, then sort (ties by request id, so the order is stable)."""
    key, largest_first = SORT_KEYS[sort]
    rows = sorted((r for r in rows if not states or r.state in states), key=lambda r: r.request_id)
    return sorted(rows, key=key, reverse=largest_first)


_COLUMNS = ("STATE", "VLT", "AGE", "LAST_TOK", "TTFT_SLACK", "TBT_SLACK", "PROMPT", "CACHED", "OUT", "HBM", "DRAM")
_WIDTHS = (7, 8, 8, 8, 10, 9, 6, 6, 5, 4, 4)


def table(rows: list[p.RequestRow], width: int | None = None) -> list[str]:
    """Header + one line per row; the id column takes what `width` leaves (all of it if None).
    A TIER column after CACHED (of those, the tokens loaded from the DRAM tier) when any has some."""
    tier = any(r.num_dram_cached_tokens for r in rows)
    columns, widths = _COLUMNS, _WIDTHS
    if tier:
        at = _COLUMNS.index("CACHED") + 1
        columns, widths = (*_COLUMNS[:at], "TIER", *_COLUMNS[at:]), (*_WIDTHS[:at], 6, *_WIDTHS[at:])
    rest = sum(widths) + len(widths)
    longest = max((len(r.request_id) for r in rows), default=2)
    id_width = max(8, min(longest, (width or 1 << 30) - rest - 1))
    line = lambda first, cells: f"{first[:id_width]:<{id_width}} " + " ".join(  # noqa: E731
        f"{c:>{w}}" for c, w in zip(cells, widths)
    )
    out = [line("ID", columns)]
    for r in rows:
        cells = (
            r.state, secs(r.vlt), secs(r.age_s), secs(r.since_last_token_s), secs(r.ttft_slack_s),
            secs(r.tbt_slack_s), str(r.num_prompt_tokens), str(r.num_cached_tokens),
            *([str(r.num_dram_cached_tokens)] if tier else []), str(r.num_output_tokens),
            str(r.num_hbm_blocks), str(r.num_dram_blocks),
        )
        out.append(line(r.request_id, cells))
    return out


def prefix_line(st: p.SchedulerStats) -> str:
    """The cache hit share of the prompt tokens routed to this scheduler (its HBM prefix cache,
    then its DRAM tier): what the gateway's cache-aware routing is for."""
    hits = st.num_prefix_hits + st.num_tier_hits
    share = pct(hits / st.num_prefix_queries) if st.num_prefix_queries else "n/a"
    return (
        f"prefix     {share} of {st.num_prefix_queries} prompt tokens routed here were cached"
        f" (hbm {st.num_prefix_hits}, dram tier {st.num_tier_hits})"
    )


def kernels_line(st: p.SchedulerStats) -> str:
    """Whether the worker runs its native kernels: without them every step is 5-10x slower."""
    if not st.worker_ready:
        return "kernels    - (no worker)"
    if not st.native_missing:
        return "kernels    native (or a GPU worker)"
    return f"kernels    NOT NATIVE ({st.native_missing}): every step runs on the torch path, 5-10x slower"


def summary(s: p.StatsReply) -> list[str]:
    """The stats/top header: load, pools, counters, and the last minute."""
    st, w = s.stats, s.window
    used = lambda total, free: f"{total - free}/{total} ({pct(1 - free / total if total else None)})"  # noqa: E731
    gbps = "n/a" if w.transfer_bytes_per_s is None else f"{w.transfer_bytes_per_s / 1e9:.2f} GB/s"
    tier = (
        f"  dram tier {st.num_cached_dram_blocks}/{st.num_tier_blocks} blocks"
        f" ({pct(st.num_cached_dram_blocks / st.num_tier_blocks)}), hits {st.num_tier_hits}/{st.num_tier_queries} tokens"
        if st.num_tier_blocks
        else ""
    )
    return [
        f"scheduler {st.scheduler_id}  model {st.model_name or '-'}  policy {s.policy}  up {secs(s.uptime_s)}"
        + ("  DRAINING" if s.draining else "")
        + ("" if st.worker_ready else "  (no worker)"),
        f"requests   running {st.num_running}  waiting {st.num_waiting}  rotary {st.num_rotary}"
        f"  finished {s.num_finished}  aborted {s.num_aborted}",
        f"kv blocks  hbm {used(st.num_hbm_blocks, st.num_free_hbm_blocks)}"
        f"  dram {used(st.num_dram_blocks, st.num_free_dram_blocks)}" + tier,
        prefix_line(st),
        kernels_line(st),
        f"totals     steps {s.num_steps}  preemptions {st.num_preemptions} (recompute {st.num_recomputes})"
        f"  rotations out {st.num_rotations_out} in {st.num_rotations_in}"
        f"  blocks in {st.num_blocks_swapped_in} out {st.num_blocks_swapped_out} mirrored {st.num_blocks_mirrored}",
        f"{f'last {w.span_s:.0f}s':<11}steps {w.num_steps}  schedule {secs(w.schedule_s)}"
        f"  transfer {secs(w.transfer_s)}  compute {secs(w.compute_s)}  stalls {pct(w.stall_ratio)}",
        f"           rotations {w.rotations_per_s:.1f}/s  transfer {gbps} ({w.blocks_moved_per_s:.1f} blocks/s)",
        f"SLO        TTFT<={secs(s.ttft_slo_s)} {pct(w.ttft_attainment)}  TBT<={secs(s.tbt_slo_s)}"
        f" {pct(w.tbt_attainment)} of gaps  both {pct(w.slo_attainment)} of {w.num_finished} requests",
    ]


def top_frame(s: p.StatsReply, rows: list[p.RequestRow], addr: str, columns: int, lines: int) -> list[str]:
    head = [f"superinfer top  {addr}  {time.strftime('%H:%M:%S')}  (Ctrl-C quits)", *summary(s), ""]
    body = table(rows, columns)
    room = max(1, lines - len(head) - 1)
    if len(body) > room:
        body = body[: room - 1] + [f"... {len(body) - room + 1} more"]
    return [line[:columns] for line in head + body]


# ---------------------------------------------------------------- commands


def cmd_queues(client: AdminClient, args) -> int:
    reply = client.ask(p.QueuesQuery())
    rows = select_rows(reply.rows, args.state, args.sort)
    if args.json:
        print(json.dumps([as_dict(r) for r in rows]))
    else:
        print("\n".join(table(rows)) + ("\n(draining)" if reply.draining else ""))
    return 0


def cmd_stats(client: AdminClient, args) -> int:
    reply = client.ask(p.StatsQuery())
    print(json.dumps(as_dict(reply)) if args.json else "\n".join(summary(reply)))
    return 0


def cmd_top(client: AdminClient, args) -> int:
    """Redraw every `interval` seconds until Ctrl-C (or `iterations` frames)."""
    tty = sys.stdout.isatty()
    out = sys.stdout
    if tty:
        out.write(_ENTER_SCREEN)
    try:
        num_frames = 0
        while True:
            stats = client.ask(p.StatsQuery())
            rows = select_rows(client.ask(p.QueuesQuery()).rows, args.state, args.sort)
            size = shutil.get_terminal_size()
            frame = top_frame(stats, rows, client.addr, size.columns, size.lines)
            if tty:
                out.write(_HOME + (_CLEAR_TO_EOL + "\n").join(frame) + _CLEAR_TO_EOL + _CLEAR_BELOW)
            else:
                out.write("\n".join(frame) + "\n\n")
            out.flush()
            num_frames += 1
            if args.iterations and num_frames >= args.iterations:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        if tty:
            out.write(_LEAVE_SCREEN)
            out.flush()


def cmd_abort(client: AdminClient, args) -> int:
    print(client.ask(p.AbortCommand(args.request_id, token=args.admin_token or "")).message)
    return 0


def cmd_drain(client: AdminClient, args) -> int:
    print(client.ask(p.DrainCommand(token=args.admin_token or "", undo=args.undo)).message)
    if args.wait and not args.undo:
        while (st := client.ask(p.StatsQuery()).stats).num_running + st.num_waiting + st.num_rotary:
            time.sleep(0.5)
        print("drained: no live requests")
    return 0


_RUN = {"queues": cmd_queues, "top": cmd_top, "stats": cmd_stats, "abort": cmd_abort, "drain": cmd_drain}


def run(args: argparse.Namespace) -> int:
    if reason := zmqsec.refusal([args.admin], args.zmq_keys, zmqsec.CLIENT):
        print(f"superinfer {args.command}: {reason}", file=sys.stderr)
        return 2
    client = AdminClient(args.admin, args.timeout, args.zmq_keys)
    try:
        return _RUN[args.command](client, args)
    except AdminFailure as e:
        print(f"superinfer {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        client.close()


# ---------------------------------------------------------------- arguments


def add_commands(sub) -> None:
    """The five commands, on the `superinfer` subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--admin",
        default=os.environ.get(ADMIN_ADDR_ENV, DEFAULT_ADMIN_ADDR),
        help=f"the scheduler's admin address (default ${ADMIN_ADDR_ENV} or {DEFAULT_ADMIN_ADDR})",
    )
    common.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer (default 5)")
    zmqsec.add_keys_arg(common)
    view = argparse.ArgumentParser(add_help=False)
    view.add_argument("--state", action="append", choices=STATES, help="only requests in this state (repeatable)")
    view.add_argument("--sort", choices=list(SORT_KEYS), default="vlt", help="order of rows (default %(default)s)")
    token = argparse.ArgumentParser(add_help=False)
    token.add_argument("--admin-token", default=os.environ.get(ADMIN_TOKEN_ENV), help=f"default ${ADMIN_TOKEN_ENV}")

    q = sub.add_parser("queues", parents=[common, view], help="one row per live request: state, VLT, SLO slack, blocks")
    q.add_argument("--json", action="store_true", help="a JSON array of rows")
    t = sub.add_parser("top", parents=[common, view], help="queues, refreshing live, with pool/transfer/SLO header")
    t.add_argument("--interval", type=float, default=1.0, help="seconds between frames (default %(default)s)")
    t.add_argument("--iterations", type=int, default=0, help="stop after N frames (default: until Ctrl-C)")
    s = sub.add_parser("stats", parents=[common], help="one-shot summary of load, pools and the last minute")
    s.add_argument("--json", action="store_true", help="a JSON object")
    a = sub.add_parser("abort", parents=[common, token], help="abort one request (needs the admin token)")
    a.add_argument("request_id")
    d = sub.add_parser("drain", parents=[common, token], help="stop admitting new requests; running ones finish")
    d.add_argument("--undo", action="store_true", help="admit new requests again")
    d.add_argument("--wait", action="store_true", help="return once no request is live")
