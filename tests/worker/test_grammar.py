"""Structured output in the runner: a constrained request's output is valid JSON for its
schema, ends with a stop token once complete, and a runner that gets the request with outputs
already generated (a failover) replays them and goes on with the same tokens."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from llguidance import LLMatcher

from services.worker.grammar import GrammarCompiler
from services.worker.runner import ModelRunner, allocate_kv_pool
from shared.protocol import NewRequestData, SamplingParams, ScheduledRequest
from tests.worker.conftest import BLOCK_SIZE, blocks_for

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
MAX_TOKENS = 40
STOP = [0, 2]  # SmolLM2's <|endoftext|> and <|im_end|>


@pytest.fixture(scope="module")
def grammars(model_path) -> GrammarCompiler:
    return GrammarCompiler(model_path)


@pytest.fixture
def runner(model, cfg, grammars) -> ModelRunner:
    pool = allocate_kv_pool(cfg, 64, BLOCK_SIZE, torch.float32, "cpu")
    return ModelRunner(model, cfg, pool, BLOCK_SIZE, "cpu", grammars=grammars)


def constrained(prompt: list[int], outputs: list[int] = (), **params) -> NewRequestData:
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    p = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=STOP, grammar=grammar, **params)
    return NewRequestData("r", list(prompt), p, list(outputs))


def serve_alone(runner: ModelRunner, req: NewRequestData, num_steps: int = MAX_TOKENS) -> list[int]:
    """Output tokens (those it came with included) after at most `num_steps` steps, or until
    a stop token."""
    runner.add_requests([req])
    known = len(req.prompt_token_ids) + len(req.output_token_ids)
    table = list(range(blocks_for(known + MAX_TOKENS)))
    step = [ScheduledRequest("r", 0, known, block_table=table)]
    for _ in range(num_steps):
        _, tokens = runner.execute(step)
        if tokens[0] in STOP:
            break
        step = [ScheduledRequest("r", len(runner.token_ids("r")) - 1, 1)]
    return runner.token_ids("r")[len(req.prompt_token_ids) :]


def test_output_is_valid_json_for_the_schema_and_ends_with_a_stop_token(runner, tokenizer, chat_prompts):
    out = serve_alone(runner, constrained(chat_prompts[0]))
    assert out[-1] in STOP, tokenizer.decode(out)
    value = json.loads(tokenizer.decode(out[:-1]))
    jsonschema.validate(value, SCHEMA)


def test_logprobs_are_those_of_the_constrained_distribution(runner, grammars, chat_prompts):
    """Logprobs are taken after the mask: every alternative with a finite logprob is a token
    the grammar allows, the sampled one among them."""
    req = constrained(chat_prompts[1], logprobs=5)
    allowed = LLMatcher(grammars.tokenizer, req.params.grammar).compute_bitmask()  # bit t: token t
    is_allowed = lambda t: allowed[t // 8] >> (t % 8) & 1  # noqa: E731
    runner.add_requests([req])
    out = runner.execute_step([ScheduledRequest("r", 0, len(chat_prompts[1]), block_table=[0, 1, 2])])
    lp = out.logprobs["r"]
    assert lp.top_ids[0] == out.token_ids[0] and is_allowed(out.token_ids[0])
    assert all(is_allowed(t) or v == float("-inf") for t, v in zip(lp.top_ids, lp.top_logprobs))
    assert any(not is_allowed(t) for t in range(1000))  # the mask did cut something


def test_a_request_added_with_outputs_replays_them_through_the_grammar(make_runner, runner, grammars, chat_prompts):
    whole = serve_alone(runner, constrained(chat_prompts[2]))
    assert len(whole) > 6
    other = make_runner()
    other.grammars = grammars
    resumed = serve_alone(other, constrained(chat_prompts[2], outputs=whole[:5]))
    assert resumed == whole
