"""The Kubernetes manifests validate offline against the Kubernetes OpenAPI schemas, with
the schemas bundled in the `kubernetes-validate` package (strict: unknown fields fail)."""

from __future__ import annotations

import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from tests.deploy.conftest import VARIANTS
from tests.deploy.kustomize import json_patch, render

# The oldest Kubernetes we support (HPA autoscaling/v2, PDB policy/v1 are GA there) and the
# newest the package knows.
K8S_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
EXPECTED_KINDS = {
    "Namespace", "ConfigMap", "Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
    "StatefulSet", "NetworkPolicy",
}


def name_of(doc: dict) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_resource_validates_against_the_kubernetes_schema(rendered, version):
    _, docs = rendered
    assert {d["kind"] for d in docs} == EXPECTED_KINDS
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name_of(doc)} invalid for Kubernetes {version}: {e.message} at {list(e.path)}")


def test_names_are_unique_and_namespaced(rendered):
    _, docs = rendered
    names = [name_of(d) for d in docs]
    assert len(names) == len(set(names))
    assert all(d["metadata"].get("namespace") == "superinfer" for d in docs if d["kind"] != "Namespace")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_python_rendering_equals_kubectl_kustomize(variant):
    out = subprocess.run(
        ["kubectl", "kustomize", str(VARIANTS[variant])], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    by_name = lambda docs: {name_of(d): d for d in docs if d}  # noqa: E731
    assert by_name(yaml.safe_load_all(out)) == by_name(render(VARIANTS[variant]))


def test_json_patch_operations():
    doc = {"a": {"b": [1, 2, 3]}, "c~/d": 1}
    json_patch(doc, {"op": "replace", "path": "/a/b/1", "value": 20})
    json_patch(doc, {"op": "add", "path": "/a/b/-", "value": 4})
    json_patch(doc, {"op": "add", "path": "/a/b/0", "value": 0})
    json_patch(doc, {"op": "remove", "path": "/a/b/2"})
    json_patch(doc, {"op": "add", "path": "/a/e", "value": {"f": 1}})
    json_patch(doc, {"op": "replace", "path": "/c~0~1d", "value": 2})
    assert doc == {"a": {"b": [0, 1, 3, 4], "e": {"f": 1}}, "c~/d": 2}
    with pytest.raises(KeyError):
        json_patch(doc, {"op": "replace", "path": "/missing", "value": 1})
    with pytest.raises(ValueError):
        json_patch(doc, {"op": "move", "path": "/a", "from": "/c~0~1d"})


def test_unsupported_kustomize_features_are_refused(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\ncommonLabels: {a: b}\n")
    with pytest.raises(ValueError, match="commonLabels"):
        render(tmp_path)
