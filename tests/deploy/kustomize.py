"""Render deploy/k8s kustomizations in Python, for tests that run without kubectl.

It does what our kustomizations use, and refuses anything else rather than ignore it:
`resources` (files, or directories with their own kustomization), `namespace`, `images`
(newName/newTag), and `patches` given inline as JSON 6902 operations on a kind/name target.
Where kubectl is installed, a test checks that this rendering equals `kubectl kustomize`.
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}


def render(directory: Path) -> list[dict]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unsupported = set(kustomization) - SUPPORTED_KEYS
    if unsupported:
        raise ValueError(f"{directory}: unsupported kustomization keys {sorted(unsupported)}")
    docs: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in kustomization.get("patches", []):
        apply_patch(docs, patch)
    if "namespace" in kustomization:
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = kustomization["namespace"]
    for image in kustomization.get("images", []):
        for container in containers(docs):
            container["image"] = retag(container["image"], image)
    return docs


def containers(docs: list[dict]) -> list[dict]:
    """Every container spec of every workload (pod templates)."""
    found = []
    for doc in docs:
        pod = doc.get("spec", {}).get("template", {}).get("spec", {})
        found += pod.get("containers", []) + pod.get("initContainers", [])
    return found


def retag(image: str, rule: dict) -> str:
    name, _, tag = image.partition(":")
    if name != rule["name"]:
        return image
    return f"{rule.get('newName', name)}:{rule.get('newTag', tag)}".rstrip(":")


def apply_patch(docs: list[dict], patch: dict) -> None:
    if set(patch) != {"target", "patch"}:
        raise ValueError(f"only inline patches with a target are supported: {sorted(patch)}")
    target = patch["target"]
    ops = yaml.safe_load(patch["patch"])
    if not isinstance(ops, list):
        raise ValueError("only JSON 6902 patches (a list of operations) are supported")
    matched = [d for d in docs if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
    if not matched:
        raise ValueError(f"patch target not found: {target}")
    for doc in matched:
        for op in ops:
            json_patch(doc, op)


def json_patch(doc: dict, op: dict) -> None:
    """One RFC 6902 add/replace/remove operation, in place."""
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    node = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        match op["op"]:
            case "add":
                node.insert(index, copy.deepcopy(op["value"]))
            case "replace":
                node[index] = copy.deepcopy(op["value"])
            case "remove":
                del node[index]
            case other:
                raise ValueError(f"unsupported patch op {other}")
        return
    match op["op"]:
        case "add":
            node[last] = copy.deepcopy(op["value"])
        case "replace":
            if last not in node:
                raise KeyError(f"replace of a missing path {op['path']}")
            node[last] = copy.deepcopy(op["value"])
        case "remove":
            del node[last]
        case other:
            raise ValueError(f"unsupported patch op {other}")
