"""A stand-in for llama.cpp's `llama-server` in `bench compare`'s tests, where the real one is not
built: the same endpoints and the same stream shape (a chunk per token, then a chunk with no text
that only carries `finish_reason`, then one with no choices that carries `usage` and `timings`,
then [DONE]), and /health 503 while "loading". Tokens are the word "x", one every --itl-ms.

    python tests/bench/llama_server_standin.py PORT [--load-s S] [--itl-ms MS]
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ALIAS = "smollm2-q4_1"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("--load-s", type=float, default=0.5)
    p.add_argument("--itl-ms", type=float, default=2.0)
    args = p.parse_args()
    ready_at = time.monotonic() + args.load_s

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:
            pass

        def setup(self) -> None:
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a write is a packet

        def reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if time.monotonic() < ready_at:  # as llama-server answers while it loads the model
                return self.reply(503, {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})
            if self.path == "/health":
                return self.reply(200, {"status": "ok"})
            if self.path == "/v1/models":
                return self.reply(200, {"object": "list", "data": [{"id": ALIAS, "object": "model", "owned_by": "llamacpp"}]})
            self.reply(404, {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            n, prompt_tokens = body["max_tokens"], len(body["prompt"].split())
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            base = {"created": int(time.time()), "model": ALIAS, "object": "text_completion", "id": "cmpl-1"}

            def event(payload: dict) -> None:
                self.wfile.write(b"data: " + json.dumps({**base, **payload}).encode() + b"\n\n")
                self.wfile.flush()

            for _ in range(n):
                time.sleep(args.itl_ms / 1000)
                event({"choices": [{"text": " x", "index": 0, "logprobs": None, "finish_reason": None}]})
            event({"choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}]})
            usage = {"completion_tokens": n, "prompt_tokens": prompt_tokens, "total_tokens": n + prompt_tokens}
            event({"choices": [], "usage": usage, "timings": {"predicted_n": n, "prompt_n": prompt_tokens}})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
