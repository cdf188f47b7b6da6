"""The HTTP API against its own `/openapi.json`: schemathesis generates requests from the
published schema (valid ones and ones just outside it) and checks that none gets a 5xx and
every response, SSE events included, matches the documented schema.

The server is the real `superinfer serve` on loopback, with a small KV pool so that valid
requests stay short (the context window is 4 blocks)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.live.server import start_server

pytestmark = pytest.mark.skipif(shutil.which("schemathesis") is None and not
                                (Path(sys.executable).parent / "schemathesis").exists(),
                                reason="schemathesis is not installed (pip install -e .[dev])")

MAX_EXAMPLES = 50  # per operation and phase
RUN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("fuzz-http"), "--hbm-blocks", "4", "--device", "cpu")
    yield srv
    srv.stop()


def schemathesis_cli() -> str:
    local = Path(sys.executable).parent / "schemathesis"
    return str(local) if local.exists() else "schemathesis"


@pytest.mark.slow
def test_openapi_fuzz_finds_no_server_error_or_schema_violation(server, tmp_path):
    args = [
        schemathesis_cli(), "run", server.base_url + "/openapi.json",
        "--checks", "not_a_server_error,response_schema_conformance",
        "--max-examples", str(MAX_EXAMPLES),
        "--request-timeout", "30",
        "--generation-deterministic",
        "--no-color",
    ]
    done = subprocess.run(args, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=tmp_path)
    # (its cwd: schemathesis writes a .schemathesis/ cache there)
    assert done.returncode == 0, f"{done.stdout[-8000:]}\n{done.stderr[-2000:]}\n{server.log_tail()}"
    assert server.proc.poll() is None, "the server died under fuzzing"
    assert server.get_json("/health")["schedulers"], "the server stopped serving"
