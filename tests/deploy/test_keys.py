"""Every ZeroMQ service in the Kubernetes manifests and the compose file starts with the
CURVE keys it needs (issue 8): its arguments and environment, parsed by `superinfer`'s own
parser, pass `zmqsec.refusal` the way the service calls it at start; the keys come from a
read-only volume mounted where `--zmq-keys` / SUPERINFER_ZMQ_KEYS points; and every client
holds a keypair its schedulers accept. The last matters on loopback too: a scheduler with
keys encrypts all its tcp sockets, so the worker beside it in its pod needs keys as well.

The key files are real ones (`zmqsec.write_keys`, what `superinfer keys DIR` writes and the
operator's Secret holds), projected into each container as its volume would project them.
"""

from __future__ import annotations

import argparse
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from unittest.mock import patch

import pytest

from shared import config, zmqsec
from tests.deploy.conftest import DEPLOY, VARIANTS
from tests.deploy.kustomize import render
from tests.deploy.test_cli_match import container_argv, container_env, parse
from tests.deploy.test_images import values

REPO = DEPLOY.parent
KEYS_SECRET = "superinfer-zmq-keys"  # created by the operator (deploy/README.md), never in the repo
KEYS_MODE = 0o440
COMPOSE_KEYS = DEPLOY / "zmq-keys"  # compose's `./zmq-keys`, relative to deploy/
ZMQ_SERVICES = ("scheduler", "worker", "gateway")


@dataclass(frozen=True)
class Service:
    where: str  # "StatefulSet/superinfer-pair/worker", "compose/gateway"
    args: argparse.Namespace
    env: dict[str, str]
    keys: Path | None  # here: what the container finds at args.zmq_keys (None: no keys given)


def parse_in_env(argv: list[str], env: dict[str, str]) -> argparse.Namespace:
    """Parse as the container does: `--zmq-keys` defaults to SUPERINFER_ZMQ_KEYS of the
    container's environment, not of the test's."""
    with patch.dict(os.environ, env, clear=True):
        return parse(argv)


def endpoints(args: argparse.Namespace) -> tuple[list[str], str]:
    """(addresses, role) each service hands `zmqsec.refusal` at start: scheduler/service.py
    run(), worker/service.py run(), gateway/server.py run() through services/cli.py."""
    match args.command:
        case "scheduler":
            return [args.bind, args.worker_bind, args.admin_bind], zmqsec.SERVER
        case "worker":
            return [args.connect], zmqsec.CLIENT
        case "gateway":
            return args.scheduler or [config.DEFAULT_SCHEDULER_ADDR], zmqsec.CLIENT
    raise AssertionError(f"not a ZeroMQ service: {args.command}")


def project(files: dict[str, Path], dest: Path) -> Path:
    """A directory holding `files` (name in the container -> source key file)."""
    dest.mkdir(parents=True)
    for name, source in files.items():
        shutil.copyfile(source, dest / name)
    return dest


def image_uid() -> int:
    [user] = {v for name in ("Dockerfile", "Dockerfile.cuda") for v in values(name, "USER")}
    return int(user)


@pytest.fixture(scope="module")
def key_files(tmp_path_factory) -> Path:
    """What `superinfer keys DIR` writes: the files of the operator's Secret and of ./zmq-keys."""
    keys = tmp_path_factory.mktemp("keys") / "zmq-keys"
    zmqsec.write_keys(str(keys))
    return keys


def accepts(server_keys: Path, client_keys: Path) -> bool:
    """Whether a CURVE handshake between these key directories succeeds: the client knows
    the server's public key and the server authorizes the client's."""
    server, client = zmqsec.load_server_keys(str(server_keys)), zmqsec.load_client_keys(str(client_keys))
    return client.server_public == server.public and client.public in server.authorized


# ---------------------------------------------------------------- Kubernetes


def key_mount(container: dict, keys_dir: str) -> dict | None:
    mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"].rstrip("/") == keys_dir.rstrip("/")]
    return mounts[0] if mounts else None


def secret_files(volume: dict, key_files: Path) -> dict[str, Path]:
    """What a Secret volume of `superinfer-zmq-keys` shows: every key, or its `items`."""
    secret = volume.get("secret")
    assert secret and secret["secretName"] == KEYS_SECRET, f"volume {volume['name']} is not Secret {KEYS_SECRET}"
    items = secret.get("items") or [{"key": p.name, "path": p.name} for p in key_files.iterdir()]
    missing = [i["key"] for i in items if not (key_files / i["key"]).is_file()]
    assert not missing, f"volume {volume['name']}: {missing} are not files of `superinfer keys`"
    return {i["path"]: key_files / i["key"] for i in items}


def k8s_containers(docs: list[dict]):
    """(where, pod, volumes by name, container, env, parsed args) for every container of a pod."""
    for doc in docs:
        pod = doc.get("spec", {}).get("template", {}).get("spec")
        if pod is None:
            continue
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for container in pod["containers"]:
            where = f"{doc['kind']}/{doc['metadata']['name']}/{container['name']}"
            env = container_env(container, docs)
            yield where, pod, volumes, container, env, parse_in_env(container_argv(container, docs), env)


def k8s_services(docs: list[dict], key_files: Path, scratch: Path) -> list[Service]:
    services = []
    for where, _, volumes, container, env, args in k8s_containers(docs):
        if args.command not in ZMQ_SERVICES:
            continue
        keys = None
        if args.zmq_keys:
            mount = key_mount(container, args.zmq_keys)
            files = secret_files(volumes[mount["name"]], key_files) if mount else {}
            keys = project(files, scratch / where) if mount else scratch / where / "not-mounted"
        services.append(Service(where, args, env, keys))
    return services


def test_k8s_key_volumes_are_the_operators_secret_read_only(rendered):
    _, docs = rendered
    for where, pod, volumes, container, _, args in k8s_containers(docs):
        assert args.zmq_keys, f"{where} has no keys: its scheduler binds off loopback"
        mount = key_mount(container, args.zmq_keys)
        assert mount, f"{where}: nothing mounted at {args.zmq_keys}"
        assert mount.get("readOnly") is True and "subPath" not in mount, where  # subPath: no key rotation
        secret = volumes[mount["name"]]["secret"]
        assert secret["secretName"] == KEYS_SECRET and not secret.get("optional"), where
        assert secret.get("defaultMode") == KEYS_MODE, where
        assert all("mode" not in item for item in secret.get("items", [])), where
        # 0440 files of group fsGroup: readable by the image's user and no one else
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"] == image_uid(), where
    assert not [d for d in docs if d["kind"] == "Secret"]  # the operator creates it


# ---------------------------------------------------------------- compose


def compose_mounts(spec: dict) -> dict[str, tuple[Path, str]]:
    """target -> (host source, options) of the service's bind mounts (short syntax)."""
    mounts = {}
    for volume in spec.get("volumes", []):
        source, target, *options = volume.split(":")
        if source.startswith((".", "/")):  # not a named volume
            mounts[target.rstrip("/")] = ((DEPLOY / source).resolve(), ",".join(options))
    return mounts


def compose_services(compose: dict, key_files: Path, scratch: Path) -> list[Service]:
    services = []
    for name, spec in compose["services"].items():
        assert "entrypoint" not in spec, name  # the image's entry point: superinfer
        env = {k: str(v) for k, v in spec.get("environment", {}).items()}
        args = parse_in_env(spec["command"], env)
        keys = None
        if args.zmq_keys:
            source, _ = compose_mounts(spec).get(args.zmq_keys.rstrip("/"), (None, ""))
            # ./zmq-keys is the directory `superinfer keys` wrote: every file of it
            files = {p.name: p for p in key_files.iterdir()} if source == COMPOSE_KEYS else None
            keys = project(files, scratch / name) if files else scratch / name / "not-mounted"
        services.append(Service(f"compose/{name}", args, env, keys))
    return services


def test_compose_keys_are_a_read_only_ignored_directory(compose):
    for name, spec in compose["services"].items():
        keys_dir = spec.get("environment", {}).get(zmqsec.KEYS_ENV)
        assert keys_dir, f"{name} has no {zmqsec.KEYS_ENV}: the scheduler binds off loopback"
        source, options = compose_mounts(spec).get(keys_dir.rstrip("/"), (None, ""))
        assert source == COMPOSE_KEYS and "ro" in options.split(","), f"{name}: {keys_dir} is not ./zmq-keys:ro"
    # never committed, never in an image
    assert "deploy/zmq-keys/" in (REPO / ".gitignore").read_text().splitlines()
    for name in ("Dockerfile", "Dockerfile.cuda"):
        rules = [r for r in (DEPLOY / f"{name}.dockerignore").read_text().splitlines() if r and r[0] != "#"]
        assert rules[0] == "*" and not [r for r in rules if r.startswith(("!deploy", "!*"))], name


# ---------------------------------------------------------------- both


@pytest.fixture(params=[*sorted(VARIANTS), "compose"])
def services(request, key_files, tmp_path, compose) -> list[Service]:
    if request.param == "compose":
        return compose_services(compose, key_files, tmp_path)
    return k8s_services(render(VARIANTS[request.param]), key_files, tmp_path)


def test_every_service_passes_its_start_check(services):
    assert {s.args.command for s in services} == set(ZMQ_SERVICES)
    refused = {}
    for s in services:
        addrs, role = endpoints(s.args)
        if reason := zmqsec.refusal(addrs, str(s.keys) if s.keys else None, role):
            refused[s.where] = reason
    assert not refused, "\n".join(f"{where}: {reason}" for where, reason in refused.items())


def test_clients_hold_keys_their_schedulers_accept(services):
    """Every client reaches schedulers of this deployment only (gateways each of them, a
    worker its own), and with keys a scheduler encrypts every tcp socket, loopback too: so
    every client needs a keypair the schedulers authorize, and their server key."""
    schedulers = [s for s in services if s.args.command == "scheduler"]
    clients = [s for s in services if s.args.command != "scheduler"]
    for server in schedulers:
        assert server.keys, f"{server.where} has no keys"
        for client in clients:
            assert client.keys, f"{client.where} has no keys: {server.where} encrypts its sockets"
            assert accepts(server.keys, client.keys), f"{server.where} refuses {client.where}"


def test_k8s_operator_commands_run_in_the_worker_container(rendered, key_files, tmp_path):
    """`kubectl exec POD -c worker -- superinfer queues` (pairs.yaml): in the worker's
    environment the admin client reaches its scheduler's admin socket, with keys it admits."""
    _, docs = rendered
    pair = {s.args.command: s for s in k8s_services(docs, key_files, tmp_path) if "/superinfer-pair/" in s.where}
    scheduler, worker = pair["scheduler"], pair["worker"]
    args = parse_in_env(["queues"], worker.env)
    assert args.admin == scheduler.args.admin_bind and args.zmq_keys == worker.args.zmq_keys
    assert zmqsec.refusal([args.admin], str(worker.keys), zmqsec.CLIENT) is None
    assert accepts(scheduler.keys, worker.keys)
