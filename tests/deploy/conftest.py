from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.deploy.kustomize import render

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
# Every kustomization an operator applies: GPU (the default) and the CPU overlay.
VARIANTS = {"gpu": K8S, "cpu": K8S / "cpu"}


@pytest.fixture(scope="session", params=sorted(VARIANTS))
def rendered(request) -> tuple[str, list[dict]]:
    """(variant, its rendered resources)."""
    return request.param, render(VARIANTS[request.param])


@pytest.fixture(scope="session")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())
