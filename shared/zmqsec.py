"""CURVE encryption and client authentication for ZeroMQ tcp endpoints.

A tcp endpoint off loopback carries prompts, tokens and operator commands between hosts:
without keys anyone who can reach it could read them or drive the scheduler. So a service
with such an endpoint refuses to start unless `--zmq-keys DIR` is given; with keys, every
tcp socket (loopback ones too) is encrypted and every client is authenticated. ipc:// and
inproc:// stay plain: the file system and the process guard them.

A key directory (`superinfer keys DIR`; zmq.auth certificate files):

    server.key          the schedulers' public key                  every client needs it
    server.key_secret   the schedulers' keypair                      schedulers only
    client.key          a client's public key: authorizes it         schedulers
    client.key_secret   the clients' keypair                         gateways, workers, operators
    NAME.key            any other file: one more authorized client   schedulers

A server accepts exactly the clients whose public key is a `*.key` file of its directory
other than server.key, checked by a ZAP handler on a thread of the service's own context.

    needs_keys(addr) -> bool              check_endpoints(addrs, keys_dir)
    refusal(addrs, keys_dir, role) -> str | None    (what a service says before exit 2)
    curve = Curve(ctx, keys_dir, log); curve.secure_server(sock, addr); curve.close()
    write_keys(keys_dir, force) -> [Path]
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # zmq is imported where it is used: `superinfer --help` need not load it
    import zmq

KEYS_ENV = "SUPERINFER_ZMQ_KEYS"
SERVER, CLIENT = "server", "client"
KEY_FILES = (f"{SERVER}.key", f"{SERVER}.key_secret", f"{CLIENT}.key", f"{CLIENT}.key_secret")
ZAP_DOMAIN = b"superinfer"
Z85_KEY_LEN = 40  # a 32-byte CURVE key in Z85 text
_LOCAL_TRANSPORTS = ("ipc", "inproc")


class KeysError(Exception):
    """An endpoint that needs keys has none, or the keys cannot be read: the service must
    not start (exit status 2)."""


# ---------------------------------------------------------------- which endpoints need keys


def _split(addr: str) -> tuple[str, str]:
    """(transport, host) of a ZeroMQ endpoint; the host of `tcp://src:port;dst:port` (a
    connect with a source address) is the destination's."""
    transport, sep, rest = addr.partition("://")
    if not sep:
        return "", ""
    dest = rest.rsplit(";", 1)[-1].split("/", 1)[0]
    host = dest.rpartition(":")[0] if ":" in dest else dest
    return transport.lower(), host.strip("[]").lower()


def is_network(addr: str) -> bool:
    """Whether the endpoint goes through the network stack (tcp and the like), where CURVE
    applies; ipc:// and inproc:// never do."""
    transport, _ = _split(addr)
    return bool(transport) and transport not in _LOCAL_TRANSPORTS


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:  # a host name, an interface name, `*`
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def needs_keys(addr: str) -> bool:
    """True for a network endpoint whose host is not loopback (127.0.0.0/8, ::1,
    localhost): `*`, 0.0.0.0, any other address, host or interface name."""
    return is_network(addr) and not _is_loopback(_split(addr)[1])


def _missing_keys_message(addr: str) -> str:
    return (
        f"{addr} is reachable from other hosts and ZeroMQ traffic is plain text without keys: "
        f"create keys with `superinfer keys DIR`, then pass `--zmq-keys DIR` (or ${KEYS_ENV}) "
        "to every scheduler, worker, gateway and operator command"
    )


def check_endpoints(addrs, keys_dir: str | None) -> None:
    """Raise `KeysError` naming the first endpoint that needs keys when none are given."""
    if keys_dir:
        return
    for addr in addrs:
        if addr and needs_keys(addr):
            raise KeysError(_missing_keys_message(addr))


def refusal(addrs, keys_dir: str | None, role: str) -> str | None:
    """Why a service must not start (None: it may), checked before anything heavy loads:
    an endpoint that needs keys without them, or keys its `role` cannot read."""
    try:
        check_endpoints(addrs, keys_dir)
        if keys_dir and any(addr and is_network(addr) for addr in addrs):
            load_server_keys(keys_dir) if role == SERVER else load_client_keys(keys_dir)
    except KeysError as e:
        return str(e)
    return None


# ---------------------------------------------------------------- key files


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    authorized: frozenset[bytes]  # client public keys (Z85) that may connect


@dataclass(frozen=True)
class ClientKeys:
    public: bytes
    secret: bytes
    server_public: bytes


def _read(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    from zmq.auth import load_certificate

    try:
        public, secret_key = load_certificate(path)
    except (OSError, ValueError) as e:
        raise KeysError(f"cannot read CURVE key file {path} ({e}); create keys with `superinfer keys DIR`") from None
    if len(public) != Z85_KEY_LEN or (secret and (secret_key is None or len(secret_key) != Z85_KEY_LEN)):
        raise KeysError(f"{path} holds no valid CURVE {'keypair' if secret else 'public key'}")
    return public, secret_key


def load_server_keys(keys_dir: str) -> ServerKeys:
    d = Path(keys_dir)
    public, secret = _read(d / f"{SERVER}.key_secret", secret=True)
    names = sorted(p for p in d.glob("*.key") if p.name != f"{SERVER}.key")
    authorized = frozenset(_read(p, secret=False)[0] for p in names)
    if not authorized:
        raise KeysError(f"no client public key (*.key besides {SERVER}.key) in {d}: no client could connect")
    return ServerKeys(public, secret, authorized)


def load_client_keys(keys_dir: str) -> ClientKeys:
    d = Path(keys_dir)
    public, secret = _read(d / f"{CLIENT}.key_secret", secret=True)
    server_public, _ = _read(d / f"{SERVER}.key", secret=False)
    return ClientKeys(public, secret, server_public)


def write_keys(keys_dir: str, force: bool = False) -> list[Path]:
    """A server and a client keypair in `keys_dir` (mode 0700; secret files 0600). Existing
    keys are kept unless `force`: replacing them locks out every service still using them."""
    from zmq.auth import create_certificates

    d = Path(keys_dir)
    existing = [d / name for name in KEY_FILES if (d / name).exists()]
    if existing and not force:
        raise KeysError(f"{existing[0]} exists; pass --force to replace the keys in {d}")
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(d, 0o700)  # before the secrets are written: nobody else can open them meanwhile
    written = []
    for name in (SERVER, CLIENT):
        public, secret = create_certificates(d, name)
        os.chmod(public, 0o644)
        os.chmod(secret, 0o600)
        written += [Path(public), Path(secret)]
    return written


# ---------------------------------------------------------------- sockets


ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # RFC 27: where libzmq asks, once per context
ZAP_POLL_MS = 100  # how often the handler looks for its stop signal


def zap_reply(frames: list[bytes], authorized: frozenset[bytes]) -> tuple[bool, list[bytes]]:
    """(allowed, reply) for one ZAP request (RFC 27): a CURVE client whose public key is in
    `authorized` (Z85) gets 200, anything else 400."""
    from zmq.utils import z85

    version, request_id, _domain, _address, _identity, mechanism, *credentials = frames
    allowed = mechanism == b"CURVE" and len(credentials) == 1 and z85.encode(credentials[0]) in authorized
    status = [b"200", b"OK"] if allowed else [b"400", b"client key not authorized"]
    return allowed, [version, request_id, *status, b"", b""]


class ZapHandler:
    """Answers the context's ZAP requests on its own thread, so handshakes go on while the
    service's event loop is busy. A plain sync REP socket and a bounded poll, so `stop()`
    returns within `ZAP_POLL_MS` whatever happened (pyzmq's ThreadAuthenticator waits on an
    asyncio poller without a timeout for its stop message)."""

    def __init__(self, ctx: zmq.Context, authorized: frozenset[bytes], log=None) -> None:
        import zmq

        # A sync shadow of the service's (asyncio) context: same ZAP endpoint, no ownership.
        self.sock = zmq.Context.shadow(ctx.underlying).socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)
        self.authorized, self.log = authorized, log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="zap", daemon=True)
        self._thread.start()  # the socket belongs to the thread from here on

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if self.sock.poll(ZAP_POLL_MS):
                    frames = self.sock.recv_multipart()
                    allowed, reply = zap_reply(frames, self.authorized)
                    self.sock.send_multipart(reply)
                    if not allowed:
                        self._refused(frames)
        finally:
            self.sock.close()

    def _refused(self, frames: list[bytes]) -> None:
        if self.log is None:
            return
        from zmq.utils import z85

        credentials = frames[6:]
        key = z85.encode(credentials[0]).decode() if len(credentials) == 1 else None
        address = frames[3].decode(errors="replace")
        self.log.warning("zmq_client_refused", reason="public key not authorized", client_key=key, address=address)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Curve:
    """One service's CURVE settings, applied to each tcp socket before bind/connect.

    A server socket needs the ZAP handler of its context running, and a context has one
    ZAP endpoint: so the handler belongs to the service (one per context), starts with its
    first server socket and stops in `close()`, before the context terminates. Without
    keys, a socket on a non-loopback endpoint raises `KeysError` here as well: nothing
    binds or connects in the clear."""

    def __init__(self, ctx: zmq.Context, keys_dir: str | None, log=None) -> None:
        self.ctx, self.keys_dir, self.log = ctx, keys_dir or None, log
        self._auth: ZapHandler | None = None

    def secure_server(self, sock: zmq.Socket, addr: str) -> None:
        """Before `sock.bind(addr)`: CURVE server, clients checked by ZAP."""
        if not self._applies(addr):
            return
        import zmq

        keys = load_server_keys(self.keys_dir)
        self._start_auth(keys.authorized)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler running: refuse, not admit
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)

    def secure_client(self, sock: zmq.Socket, addr: str) -> None:
        """Before `sock.connect(addr)`: this client's keypair and the server's public key."""
        if not self._applies(addr):
            return
        import zmq

        keys = load_client_keys(self.keys_dir)
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)

    def close(self) -> None:
        """Stop the ZAP handler; call before the context terminates (it holds sockets)."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def _applies(self, addr: str) -> bool:
        if self.keys_dir is None:
            check_endpoints([addr], None)
            return False
        return is_network(addr)

    def _start_auth(self, authorized: frozenset[bytes]) -> None:
        if self._auth is None:
            self._auth = ZapHandler(self.ctx, authorized, self.log)


# ---------------------------------------------------------------- command line


def add_keys_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--zmq-keys",
        metavar="DIR",
        default=os.environ.get(KEYS_ENV) or None,
        help="CURVE keys (from `superinfer keys DIR`): encrypt and authenticate every tcp:// ZeroMQ "
        f"socket; required when one is not on loopback (default ${KEYS_ENV})",
    )


def add_keys_command(sub) -> None:
    k = sub.add_parser("keys", help="write CURVE keypairs for --zmq-keys (server and client) into a directory")
    k.add_argument("dir", metavar="DIR")
    k.add_argument("--force", action="store_true", help="replace existing keys (every service needs the new ones)")


def run_keys(args: argparse.Namespace) -> int:
    try:
        written = write_keys(args.dir, args.force)
    except (KeysError, OSError) as e:
        print(f"superinfer keys: {e}", file=sys.stderr)
        return 2
    print("\n".join(str(p) for p in written))
    print(f"pass --zmq-keys {args.dir} to schedulers, workers, gateways and operator commands", file=sys.stderr)
    return 0
