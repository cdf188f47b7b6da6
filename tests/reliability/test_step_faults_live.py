"""A raising step and a frozen worker on real processes: a scheduler, a worker and a gateway
started alone (`superinfer scheduler|worker|gateway` on loopback tcp://, no supervisor), the
bundled model, real HTTP. The server keeps serving with no restart."""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import pytest

from tests.reliability.live import PROMPTS, client_for, stream_all
from tests.scaleout.cluster import health, spawn, start_gateway, start_pair, wait_until

STARTUP_S = 240


class Http:
    """What `client_for` needs of a server."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url


def poison_token() -> int:
    """A token id in a prompt of ours and in none of PROMPTS."""
    from shared.modelfile import resolve_model_path
    from shared.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path(None))
    used = {t for q in PROMPTS for t in tok.encode(q)}
    return next(t for t in tok.encode(" quokka zebra") if t not in used)


def model_name() -> str:
    from shared.modelfile import default_model_path, read_model_config

    return read_model_config(default_model_path()).name


def ready(url: str) -> bool:
    return any(s.get("worker_ready") for s in health(url).get("schedulers") or [])


def start(tmp_path, procs: list):
    # A recomputed request's greedy tokens are those of an undisturbed run: on the default dtype
    # (the GGUF packed, int8 activations) too, its attention being batch-invariant.
    pair = start_pair(tmp_path, "a", "--hbm-blocks", "256", "--dram-gb", "0.25")
    gateway, url = start_gateway(tmp_path, [pair.addr])
    procs += [pair.worker, pair.scheduler, gateway]
    assert wait_until(lambda: ready(url), STARTUP_S, procs), "no ready worker"
    return pair, url


async def complete(url: str, model: str, prompt: str) -> tuple[int, dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as resp:
            return resp.status, await resp.json()


@pytest.mark.slow
@pytest.mark.timeout(1800)  # three processes and a model start; a busy host is slow
def test_raising_steps_with_the_worker_alone_fail_only_the_request_that_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("SUPERINFER_FAULTS", f"step=12,token={poison_token()}")
    procs: list = []
    try:
        pair, url = start(tmp_path, procs)
        model = model_name()
        client = client_for(Http(url))

        async def scenario():
            first = await stream_all(client, model, [])  # the 12th plan raises once, in here
            streams = asyncio.create_task(stream_all(client, model, []))
            await asyncio.sleep(0.5)
            poisoned = await complete(url, model, "Tell me about the quokka zebra.")
            again = await streams
            after = await complete(url, model, PROMPTS[0])  # the next request is served
            return first, poisoned, again, after

        first, (status, err), again, (after_status, after) = asyncio.run(scenario())
        assert status == 500 and "InjectedFault" in err["error"]["message"], (status, err)
        assert first == again  # nothing disturbed the others
        assert after_status == 200 and after["usage"]["completion_tokens"] == 16
        worker_log = "\n".join(pair.worker.log_lines())
        assert "step_failed_rerunning" in worker_log and "step 12 raises once" in worker_log
        assert "step_failed_requests" in worker_log
        assert not pair.scheduler.log_events("worker lost; holding live requests for the next worker")
        assert all(p.alive() for p in procs)
    finally:
        for p in procs:
            p.stop()


async def freeze_under_load(url: str, model: str, pair, thaw) -> list[str]:
    """Stream PROMPTS; once a quarter of the tokens are in, SIGSTOP the worker until the
    scheduler declares it lost, then `thaw(worker pid)`; returns the texts."""
    client = client_for(Http(url))  # one per event loop
    token_times: list[float] = []
    run = asyncio.create_task(stream_all(client, model, token_times))
    while len(token_times) < len(PROMPTS) * 12 and not run.done():
        await asyncio.sleep(0.01)
    assert not run.done(), "the streams ended before the freeze"
    lost = len(pair.scheduler.log_events("worker lost; holding live requests for the next worker"))
    os.kill(pair.worker.popen.pid, signal.SIGSTOP)
    for _ in range(600):
        if len(pair.scheduler.log_events("worker lost; holding live requests for the next worker")) > lost:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the frozen worker was never declared lost")
    await asyncio.sleep(1.0)
    thaw(pair.worker.popen.pid)
    return await run


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_worker_frozen_past_the_step_deadline_holds_requests_until_sigcont_or_a_replacement(tmp_path):
    procs: list = []
    try:
        pair, url = start(tmp_path, procs)
        model = model_name()
        reference = asyncio.run(stream_all(client_for(Http(url)), model, []))

        thawed = asyncio.run(freeze_under_load(url, model, pair, lambda pid: os.kill(pid, signal.SIGCONT)))
        assert thawed == reference  # held, resumed, every token once
        assert "scheduler asked for a reset" in "\n".join(pair.worker.log_lines())

        def replace(pid: int) -> None:
            pair.worker.kill()
            pair.worker = spawn(tmp_path, "a-worker-2", *pair.worker.popen.args[3:])
            procs.append(pair.worker)

        replaced = asyncio.run(freeze_under_load(url, model, pair, replace))
        assert replaced == reference
        assert wait_until(lambda: ready(url), 60, procs)
    finally:
        for p in procs:
            p.stop()
