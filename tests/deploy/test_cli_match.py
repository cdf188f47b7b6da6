"""Ports, probes and flags in the Kubernetes manifests and the compose file match the CLI:
every container's arguments parse with `superinfer`'s own parser (after the `$(VAR)`
expansion Kubernetes does from the container's environment), and every port a probe, a
Service, a policy or a peer uses is the one the flags bind."""

from __future__ import annotations

import argparse
import re
from urllib.parse import urlsplit

import pytest

from services.cli import build_parser

GATEWAY, SCHEDULER, WORKER = "gateway", "scheduler", "worker"


def parse(args: list[str]) -> argparse.Namespace:
    try:
        return build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"superinfer does not accept {args}")


def host_port(addr: str) -> tuple[str, int]:
    url = urlsplit(addr)
    assert url.scheme == "tcp", addr
    return url.hostname, url.port


# ---------------------------------------------------------------- Kubernetes


def find(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def pod_containers(workload: dict) -> dict[str, dict]:
    return {c["name"]: c for c in workload["spec"]["template"]["spec"]["containers"]}


def container_env(container: dict, docs: list[dict]) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(find(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            ref = var["valueFrom"]["configMapKeyRef"]
            env[var["name"]] = find(docs, "ConfigMap", ref["name"])["data"][ref["key"]]
    return env


def container_argv(container: dict, docs: list[dict]) -> list[str]:
    """The arguments the image's entry point (`superinfer`) gets, `$(VAR)` expanded from the
    container's environment as Kubernetes does."""
    assert container.get("command", ["superinfer"]) == ["superinfer"], container["name"]
    env = container_env(container, docs)

    def expand(arg: str) -> str:
        unresolved = [v for v in re.findall(r"\$\((\w+)\)", arg) if v not in env]
        assert not unresolved, f"{container['name']}: {unresolved} not in the container's environment"
        return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)

    return [expand(a) for a in container["args"]]


def container_args(container: dict, docs: list[dict]) -> argparse.Namespace:
    """The container's command line as Kubernetes runs it: image entry point + args."""
    return parse(container_argv(container, docs))


def port_number(container: dict, port: int | str) -> int:
    """A probe's or Service's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    named = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    assert named, f"{container['name']} has no port named {port!r}"
    return named[0]


def probe_port(container: dict, probe: str) -> int:
    spec = container[probe]
    action = spec.get("httpGet") or spec.get("tcpSocket")
    return port_number(container, action["port"])


def selects(selector: dict, workload: dict) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in selector.items())


def test_gateway_flags_ports_and_probes(rendered):
    _, docs = rendered
    deployment = find(docs, "Deployment", "superinfer-gateway")
    gateway = pod_containers(deployment)[GATEWAY]
    args = container_args(gateway, docs)
    assert args.command == GATEWAY and args.host == "0.0.0.0"
    assert port_number(gateway, "http") == args.port
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    assert probe_port(gateway, "readinessProbe") == probe_port(gateway, "livenessProbe") == args.port
    service = find(docs, "Service", "superinfer-gateway")
    assert selects(service["spec"]["selector"], deployment)
    assert [port_number(gateway, p["targetPort"]) for p in service["spec"]["ports"]] == [args.port]


def test_gateways_reach_every_scheduler_on_its_bind_port(rendered):
    _, docs = rendered
    pairs = find(docs, "StatefulSet", "superinfer-pair")
    scheduler = pod_containers(pairs)[SCHEDULER]
    sched_args = container_args(scheduler, docs)
    assert sched_args.command == SCHEDULER
    bind_host, bind_port = host_port(sched_args.bind)
    assert bind_host == "0.0.0.0"  # gateways are other pods
    assert port_number(scheduler, "zmq") == bind_port
    assert probe_port(scheduler, "readinessProbe") == probe_port(scheduler, "livenessProbe") == bind_port

    headless = find(docs, "Service", pairs["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and selects(headless["spec"]["selector"], pairs)
    assert [(p["port"], port_number(scheduler, p["targetPort"])) for p in headless["spec"]["ports"]] == [
        (bind_port, bind_port)
    ]
    gateway_args = container_args(pod_containers(find(docs, "Deployment", "superinfer-gateway"))[GATEWAY], docs)
    sts, svc = pairs["metadata"]["name"], headless["metadata"]["name"]
    pod_names = [f"{sts}-{i}.{svc}" for i in range(pairs["spec"]["replicas"])]
    assert [host_port(a) for a in gateway_args.scheduler] == [(name, bind_port) for name in pod_names]

    policy = find(docs, "NetworkPolicy", "superinfer-scheduler")
    assert selects(policy["spec"]["podSelector"]["matchLabels"], pairs)
    [rule] = policy["spec"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == [bind_port]
    [source] = rule["from"]
    assert selects(source["podSelector"]["matchLabels"], find(docs, "Deployment", "superinfer-gateway"))


def test_worker_connects_to_its_own_scheduler_and_requests_its_memory(rendered):
    variant, docs = rendered
    containers = pod_containers(find(docs, "StatefulSet", "superinfer-pair"))
    sched_args = container_args(containers[SCHEDULER], docs)
    worker = containers[WORKER]
    args = container_args(worker, docs)
    assert args.command == WORKER
    assert host_port(args.connect) == host_port(sched_args.worker_bind) == ("127.0.0.1", host_port(args.connect)[1])

    resources = worker["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"]  # pinned: never swapped
    assert memory_bytes(resources["requests"]["memory"]) >= (args.dram_gb + 1) * 2**30
    gpus = {k: r.get("nvidia.com/gpu") for k, r in resources.items()}
    if variant == "gpu":
        assert args.device == "cuda" and gpus["requests"] == gpus["limits"] >= 1
    else:
        assert args.device == "cpu" and args.hbm_blocks and gpus == {"requests": None, "limits": None}


def test_autoscaler_targets_the_gateways_which_request_cpu(rendered):
    _, docs = rendered
    hpa = find(docs, "HorizontalPodAutoscaler", "superinfer-gateway")
    deployment = find(docs, "Deployment", hpa["spec"]["scaleTargetRef"]["name"])
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    # A CPU utilization target needs a CPU request on every container it averages over.
    assert all("cpu" in c["resources"]["requests"] for c in pod_containers(deployment).values())


def test_images_are_the_variant_build(rendered):
    variant, docs = rendered
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    images = {name: c["image"] for d in workloads for name, c in pod_containers(d).items()}
    # the worker runs the variant's full image; the gateway and scheduler the control image, no torch
    assert images == {WORKER: f"superinfer:{'cuda' if variant == 'gpu' else 'cpu'}",
                      GATEWAY: "superinfer-control", SCHEDULER: "superinfer-control"}


def memory_bytes(quantity: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", quantity).groups()
    return float(number) * units.get(unit, 1)


# ---------------------------------------------------------------- compose


def compose_args(compose: dict, service: str) -> argparse.Namespace:
    spec = compose["services"][service]
    assert "entrypoint" not in spec, service  # the image's entry point: superinfer
    return parse(spec["command"])


def test_compose_services_parse_and_connect_on_the_bound_ports(compose):
    services = compose["services"]
    assert set(services) == {GATEWAY, SCHEDULER, WORKER}
    sched = compose_args(compose, SCHEDULER)
    worker = compose_args(compose, WORKER)
    gateway = compose_args(compose, GATEWAY)
    assert (sched.command, worker.command, gateway.command) == (SCHEDULER, WORKER, GATEWAY)
    (bind_host, bind_port), (wbind_host, wbind_port) = host_port(sched.bind), host_port(sched.worker_bind)
    assert bind_host == wbind_host == "0.0.0.0"  # peers are other containers
    assert host_port(worker.connect) == (SCHEDULER, wbind_port)
    assert [host_port(a) for a in gateway.scheduler] == [(SCHEDULER, bind_port)]
    assert gateway.host == "0.0.0.0"
    assert [p.rsplit(":", 1)[1] for p in services[GATEWAY]["ports"]] == [str(gateway.port)]
    assert f"('127.0.0.1', {bind_port})" in " ".join(services[SCHEDULER]["healthcheck"]["test"])
    assert f"http://127.0.0.1:{gateway.port}/health" in " ".join(services[GATEWAY]["healthcheck"]["test"])
    for name, spec in services.items():
        assert set(spec.get("depends_on", {})) <= set(services) - {name}
        if name == WORKER:
            assert spec["build"]["dockerfile"] == "deploy/Dockerfile" and spec["image"] == "superinfer:cpu"
        else:  # no torch in the gateway's and scheduler's image
            assert spec["build"]["dockerfile"] == "deploy/Dockerfile.control" and spec["image"] == "superinfer-control"
