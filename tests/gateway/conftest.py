from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import pytest

from services.gateway.server import serve
from shared.modelfile import default_model_path
from shared.tokenizer import ModelTokenizer, load_tokenizer


@pytest.fixture(scope="session")
def model_path():
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(model_path) -> ModelTokenizer:
    return load_tokenizer(model_path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_listening(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url + "/health"):
                    return
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.1)
    raise TimeoutError(url)


@pytest.fixture(scope="module")
def lone_gateway(tmp_path_factory):
    """An in-process gateway whose scheduler address has nobody behind it; yields
    `call(method, path, json=None, headers=None) -> (status, headers, body)`."""
    port, addr = free_port(), f"ipc://{tmp_path_factory.mktemp('gw')}/nobody.sock"
    url = f"http://127.0.0.1:{port}"
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    task = loop.create_task(serve("127.0.0.1", port, [addr], None, api_key="sekret", stop=stop))
    loop.run_until_complete(wait_listening(url))

    def call(method, path, body=None, headers=None):
        async def go():
            async with aiohttp.ClientSession() as s:
                async with s.request(method, url + path, json=body, headers=headers) as r:
                    return r.status, dict(r.headers), await r.read()

        return loop.run_until_complete(go())

    yield call
    stop.set()
    t0 = time.monotonic()
    loop.run_until_complete(task)
    assert time.monotonic() - t0 < 3.0
    loop.close()


AUTH = {"Authorization": "Bearer sekret"}
