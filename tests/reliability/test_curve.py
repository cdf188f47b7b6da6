"""CURVE on ZeroMQ tcp endpoints: which endpoints need keys, the key files, real sockets
that let only authorized clients through, services that refuse to start in the clear, and
scheduler + worker + gateway as separate processes serving a chat completion with keys."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import structlog
import zmq
import zmq.asyncio
from structlog.testing import capture_logs

from bench.live.server import REPO, STARTUP_TIMEOUT_S, free_port
from services import cli
from shared import protocol as p, zmqsec
from tests.scaleout.cluster import health, post_json, spawn, wait_until

WAIT_MS = 1000  # a message that gets through does so well within this on loopback
ENV = {k: v for k, v in os.environ.items() if k != zmqsec.KEYS_ENV}


@pytest.fixture
def keys(tmp_path) -> str:
    d = tmp_path / "keys"
    zmqsec.write_keys(str(d))
    return str(d)


# ---------------------------------------------------------------- which endpoints need keys


@pytest.mark.parametrize(
    "addr, needed",
    [
        ("tcp://127.0.0.1:5557", False),
        ("tcp://127.3.4.5:5557", False),
        ("tcp://localhost:5557", False),
        ("tcp://LOCALHOST:5557", False),
        ("tcp://[::1]:5557", False),
        ("tcp://[::ffff:127.0.0.1]:5557", False),
        ("tcp://127.0.0.1:6000;127.0.0.1:5557", False),  # connect with a source address
        ("ipc:///tmp/superinfer/scheduler.sock", False),
        ("inproc://zeromq.zap.01", False),
        ("off", False),  # --admin-bind off: no endpoint at all
        ("tcp://0.0.0.0:5557", True),
        ("tcp://*:5557", True),
        ("tcp://[::]:5557", True),
        ("tcp://10.0.0.7:5557", True),
        ("tcp://superinfer-pair-0.superinfer-scheduler:5557", True),
        ("tcp://eth0:5557", True),
        ("tcp://127.0.0.1:6000;10.0.0.7:5557", True),  # the destination decides
        ("TCP://0.0.0.0:5557", True),
    ],
)
def test_needs_keys(addr, needed):
    assert zmqsec.needs_keys(addr) is needed


def test_check_endpoints_names_the_address_and_the_fix():
    zmqsec.check_endpoints(["tcp://127.0.0.1:5557", "ipc:///tmp/x.sock", "off"], None)
    zmqsec.check_endpoints(["tcp://0.0.0.0:5557"], "/some/keys")
    with pytest.raises(zmqsec.KeysError) as e:
        zmqsec.check_endpoints(["tcp://127.0.0.1:5558", "tcp://0.0.0.0:5557"], None)
    assert "tcp://0.0.0.0:5557" in str(e.value) and "127.0.0.1" not in str(e.value)
    assert "superinfer keys DIR" in str(e.value) and "--zmq-keys DIR" in str(e.value)


def test_refusal_reads_the_keys_of_the_role(tmp_path, keys):
    addrs = ["tcp://0.0.0.0:5557"]
    assert zmqsec.refusal(addrs, keys, zmqsec.SERVER) is None
    assert zmqsec.refusal(addrs, keys, zmqsec.CLIENT) is None
    assert zmqsec.refusal(["ipc:///tmp/x.sock"], str(tmp_path / "none"), zmqsec.SERVER) is None  # nothing uses them
    reason = zmqsec.refusal(addrs, str(tmp_path / "none"), zmqsec.CLIENT)
    assert "client.key_secret" in reason and "superinfer keys" in reason
    os.remove(Path(keys) / "client.key")
    assert zmqsec.refusal(addrs, keys, zmqsec.CLIENT) is None  # a client needs no client.key
    assert "no client public key" in zmqsec.refusal(addrs, keys, zmqsec.SERVER)  # nobody could connect
    (Path(keys) / "server.key_secret").write_text("curve\n    public-key = \"short\"\n")
    assert "no valid CURVE keypair" in zmqsec.refusal(addrs, keys, zmqsec.SERVER)


def test_keys_command_writes_private_files_and_keeps_existing_ones(tmp_path):
    d = tmp_path / "new" / "keys"
    assert cli.main(["keys", str(d)]) == 0
    assert sorted(f.name for f in d.iterdir()) == sorted(zmqsec.KEY_FILES)
    assert d.stat().st_mode & 0o777 == 0o700
    assert {f.name: f.stat().st_mode & 0o777 for f in d.glob("*.key_secret")} == {
        "server.key_secret": 0o600,
        "client.key_secret": 0o600,
    }
    before = zmqsec.load_server_keys(str(d))
    assert cli.main(["keys", str(d)]) == 2
    assert zmqsec.load_server_keys(str(d)) == before
    assert cli.main(["keys", str(d), "--force"]) == 0
    after = zmqsec.load_server_keys(str(d))
    assert after.secret != before.secret and after.authorized == {zmqsec.load_client_keys(str(d)).public}


# ---------------------------------------------------------------- real sockets


def fresh_keypair(keys: str) -> tuple[bytes, bytes, bytes]:
    """A client keypair the server never heard of, with the right server key."""
    public, secret = zmq.curve_keypair()
    return public, secret, zmqsec.load_client_keys(keys).server_public


def wrong_server_key(keys: str) -> tuple[bytes, bytes, bytes]:
    """The authorized client keypair, with some other server's key."""
    client = zmqsec.load_client_keys(keys)
    return client.public, client.secret, zmq.curve_keypair()[0]


def with_keypair(sock: zmq.Socket, public: bytes, secret: bytes, server_public: bytes) -> None:
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server_public


async def exchange(addr: str, keys: str, client_keys=None, stop_auth: bool = False) -> bytes | None:
    """A ROUTER server set up as the services do (asyncio context, `Curve`), a DEALER
    client in its own context: the reply to a ping, or None when nothing got through."""
    ctx, client_ctx = zmq.asyncio.Context(), zmq.Context()
    curve = zmqsec.Curve(ctx, keys, structlog.get_logger())
    server = ctx.socket(zmq.ROUTER)
    client = client_ctx.socket(zmq.DEALER)
    try:
        curve.secure_server(server, addr)
        server.bind(addr)
        if stop_auth:
            curve.close()
        endpoint = server.getsockopt_string(zmq.LAST_ENDPOINT)
        if client_keys == "service":
            zmqsec.Curve(client_ctx, keys).secure_client(client, endpoint)
        elif client_keys is not None:
            with_keypair(client, *client_keys)
        client.connect(endpoint)
        client.send(b"ping")
        if not await server.poll(WAIT_MS):
            return None
        identity, payload = await server.recv_multipart()
        await server.send_multipart([identity, payload.replace(b"ping", b"pong")])
        return client.recv() if client.poll(WAIT_MS) else None
    finally:
        client.close(linger=0)
        server.close(linger=0)
        curve.close()
        client_ctx.term()
        ctx.term()


TCP = "tcp://127.0.0.1:*"


def test_an_authorized_client_talks_over_curve(keys):
    assert asyncio.run(exchange(TCP, keys, "service")) == b"pong"


BAD_CLIENTS = {"plain": lambda keys: None, "wrong server key": wrong_server_key, "unauthorized": fresh_keypair}


@pytest.mark.parametrize("client", list(BAD_CLIENTS))
def test_a_client_without_the_right_keys_gets_nothing_through(keys, client):
    client_keys = BAD_CLIENTS[client](keys)
    with capture_logs() as logs:
        assert asyncio.run(exchange(TCP, keys, client_keys)) is None
    refused = [e for e in logs if e["event"] == "zmq_client_refused"]
    if client == "unauthorized":  # the handshake got as far as ZAP: the server says who
        assert refused and refused[0]["client_key"] == client_keys[0].decode()
    else:
        assert not refused


def test_another_public_key_in_the_directory_authorizes_its_client(keys):
    public, secret, server_public = fresh_keypair(keys)
    (Path(keys) / "operator.key").write_text(f'curve\n    public-key = "{public.decode()}"\n')
    assert asyncio.run(exchange(TCP, keys, (public, secret, server_public))) == b"pong"


def test_without_its_zap_handler_a_server_admits_nobody(keys):
    assert asyncio.run(exchange(TCP, keys, "service", stop_auth=True)) is None


def test_ipc_stays_plain_with_keys(keys, tmp_path):
    assert asyncio.run(exchange(f"ipc://{tmp_path}/s.sock", keys, None)) == b"pong"


def test_no_socket_binds_or_connects_in_the_clear_off_loopback():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        with pytest.raises(zmqsec.KeysError):
            zmqsec.Curve(ctx, None).secure_server(sock, "tcp://0.0.0.0:5557")
        with pytest.raises(zmqsec.KeysError):
            zmqsec.Curve(ctx, None).secure_client(sock, "tcp://10.0.0.7:5557")
        zmqsec.Curve(ctx, None).secure_client(sock, "tcp://127.0.0.1:5557")  # loopback: plain is fine
    finally:
        sock.close(linger=0)
        ctx.term()


# ---------------------------------------------------------------- services


def superinfer(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "services.cli", *args]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout, check=False)


OFF_HOST = "tcp://192.0.2.1"  # TEST-NET-1: never reached, the services refuse first


@pytest.mark.parametrize(
    "args, addr",
    [
        (("scheduler", "--bind", "tcp://0.0.0.0:{port}", "--worker-bind", "tcp://127.0.0.1:{port2}",
          "--admin-bind", "off"), "tcp://0.0.0.0:{port}"),
        (("worker", "--connect", f"{OFF_HOST}:5558", "--device", "cpu"), f"{OFF_HOST}:5558"),
        (("gateway", "--scheduler", f"{OFF_HOST}:5557", "--port", "{port}"), f"{OFF_HOST}:5557"),
        (("stats", "--admin", f"{OFF_HOST}:5559"), f"{OFF_HOST}:5559"),
    ],
    ids=["scheduler", "worker", "gateway", "stats"],
)
def test_services_refuse_to_start_in_the_clear(args, addr):
    ports = {"port": free_port(), "port2": free_port()}
    t0 = time.monotonic()
    done = superinfer(*(a.format(**ports) for a in args))
    assert done.returncode == 2, done.stderr
    assert time.monotonic() - t0 < 30  # at once, not after loading a model
    [line] = [line for line in done.stderr.splitlines() if addr.format(**ports) in line]
    assert "superinfer keys DIR" in line and "--zmq-keys DIR" in line
    assert "model loaded" not in done.stderr


def hello_reply(addr: str, keys: str | None) -> p.GatewayReply | None:
    """Say hello as a gateway would; the scheduler answers with its load report."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        zmqsec.Curve(ctx, keys).secure_client(sock, addr)
        sock.connect(addr)
        sock.send(p.encode(p.GatewayHello(gateway_id="gw-curve-test")))
        return p.gateway_reply_decoder.decode(sock.recv()) if sock.poll(WAIT_MS) else None
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.mark.timeout(120)
def test_scheduler_on_all_interfaces_starts_with_keys_and_answers_only_keyed_clients(tmp_path, keys):
    port = free_port()
    scheduler = spawn(
        tmp_path, "scheduler", "scheduler", "--bind", f"tcp://0.0.0.0:{port}",
        "--worker-bind", f"tcp://127.0.0.1:{free_port()}", "--admin-bind", "off", "--zmq-keys", keys,
    )
    try:
        assert wait_until(lambda: scheduler.log_events("scheduler up"), 60, [scheduler])
        assert isinstance(hello_reply(f"tcp://127.0.0.1:{port}", keys), p.SchedulerStats)
        assert hello_reply(f"tcp://127.0.0.1:{port}", None) is None
        assert scheduler.log_events("zmq_client_refused") == []  # a plain client never reaches ZAP
    finally:
        scheduler.stop()
    assert scheduler.popen.returncode == 0, scheduler.log_lines()[-20:]  # the ZAP thread did not block exit


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_separate_services_serve_a_chat_completion_over_curve(tmp_path, keys):
    sched_addr, worker_addr, admin_addr = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
    key_args = ("--zmq-keys", keys)
    scheduler = spawn(
        tmp_path, "scheduler", "scheduler", "--bind", sched_addr, "--worker-bind", worker_addr,
        "--admin-bind", admin_addr, *key_args,
    )
    worker = spawn(
        tmp_path, "worker", "worker", "--connect", worker_addr, "--device", "cpu", "--hbm-blocks", "64",
        "--dram-gb", "0.25", *key_args,
    )
    port = free_port()
    gateway = spawn(
        tmp_path, "gateway", "gateway", "--host", "127.0.0.1", "--port", str(port), "--scheduler", sched_addr,
        *key_args,
    )
    procs = [scheduler, worker, gateway]
    base_url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: health(base_url).get("schedulers"), STARTUP_TIMEOUT_S, procs), health(base_url)
        body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
        status, reply = post_json(base_url + "/v1/chat/completions", body)
        assert status == 200, reply
        assert reply["usage"]["completion_tokens"] >= 1 and reply["choices"][0]["message"]["content"]

        stats = superinfer("stats", "--admin", admin_addr, "--json", *key_args)
        assert stats.returncode == 0 and '"num_finished": 1' in stats.stdout, stats.stderr
        plain = superinfer("stats", "--admin", admin_addr, "--timeout", "1")
        assert plain.returncode == 1 and "no answer" in plain.stderr
    finally:
        for proc in reversed(procs):
            proc.stop()
