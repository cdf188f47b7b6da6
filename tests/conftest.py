"""Fixtures shared across the suite: a live `superinfer serve` subprocess on loopback."""

from __future__ import annotations

import pytest

from bench.live.server import Server, start_server


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    """One shared server on the embedded default (bundled model, CPU)."""
    srv = start_server(tmp_path_factory.mktemp("serve"))
    yield srv
    srv.stop()
