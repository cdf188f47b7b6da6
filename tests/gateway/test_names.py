"""`superinfer serve` with vLLM's serving flags: --served-model-name, --max-model-len, --seed
and an API key, against the whole stack."""

from __future__ import annotations

import json
import random
from pathlib import Path

import openai
import pytest

from bench.live.server import children_of, start_server

NAMES = ["my-model", "other-name"]
MAX_MODEL_LEN = 64
SEED = 5
KEY = "sekret-key"


@pytest.fixture(scope="module")
def named(tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("named"),
        "--served-model-name", *NAMES,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--seed", str(SEED),
        "--api-key", KEY,
    )  # fmt: skip
    yield srv
    srv.stop()


def client(server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=120)


def sampled(server, **kw) -> str:
    r = client(server).completions.create(model=NAMES[0], prompt="Once upon a time", max_tokens=8, **kw)
    return r.choices[0].text


def test_seed_makes_requests_without_one_reproducible(named):
    """The first request without a seed samples with the first seed the --seed generator draws
    (this test runs first: no generation reached the gateway before it)."""
    unseeded = sampled(named, temperature=1.0)
    first_seed = random.Random(SEED).getrandbits(63)
    assert sampled(named, temperature=1.0, seed=first_seed) == unseeded


def test_served_names_are_listed_and_the_only_ones_accepted(named):
    models = client(named).models.list().data
    assert [m.id for m in models] == NAMES
    for name in NAMES:
        r = client(named).chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
        )
        assert r.model == name
    with pytest.raises(openai.NotFoundError) as e:
        client(named).completions.create(model=named.model, prompt="hi", max_tokens=2)  # the model's own name
    assert e.value.body["code"] == "model_not_found"


def test_max_model_len_caps_the_context_window(named):
    assert {m.model_extra["max_model_len"] for m in client(named).models.list().data} == {MAX_MODEL_LEN}
    with pytest.raises(openai.BadRequestError) as e:
        client(named).completions.create(model=NAMES[0], prompt=[1] * MAX_MODEL_LEN, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client(named).completions.create(model=NAMES[0], prompt=[1] * 60, max_tokens=5)
    assert e.value.body["param"] == "max_tokens"
    r = client(named).completions.create(model=NAMES[0], prompt=[1] * 60, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens + r.usage.completion_tokens <= MAX_MODEL_LEN


def test_the_api_key_is_required_and_on_no_child_command_line(named):
    with pytest.raises(openai.AuthenticationError):
        client(named, key="wrong").models.list()
    cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in children_of(named.proc.pid)]
    assert len(cmdlines) == 3 and not any(KEY.encode() in c for c in cmdlines)
    assert json.dumps(client(named).models.list().model_dump())  # the right key is accepted
