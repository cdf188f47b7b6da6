"""Logprobs and logit processors through the real runner and model: logprobs are those of the
model's own distribution (checked against transformers' forward), and each processor changes
the draw the way vLLM's does."""

from __future__ import annotations

import torch

from services.worker.logits import process_row
from services.worker.runner import ModelRunner
from shared.protocol import NewRequestData, SamplingParams, ScheduledRequest
from tests.worker.conftest import blocks_for, generate_together, greedy

NUM_NEW = 6


def run_chunked(runner: ModelRunner, req: NewRequestData, num_new: int, chunk: int):
    """Prefill `req` in chunks of `chunk` tokens, then decode; returns every step's StepTokens."""
    n = len(req.prompt_token_ids)
    runner.add_requests([req])
    table = list(range(blocks_for(n + num_new)))
    outs, start = [], 0
    while start < n:
        size = min(chunk, n - start)
        first = table if start == 0 else None
        outs.append(runner.execute_step([ScheduledRequest(req.request_id, start, size, block_table=first)]))
        start += size
    while len(outs[-1].token_ids) and len(runner.token_ids(req.request_id)) < n + num_new:
        known = len(runner.token_ids(req.request_id))
        outs.append(runner.execute_step([ScheduledRequest(req.request_id, known - 1, 1)]))
    return outs


def test_logprobs_are_the_models_distribution(make_runner, hf_model, chat_prompts):
    """Greedy's token is its own top-1; the sampled and prompt logprobs equal transformers'
    log_softmax at every position, with a prefill split in unaligned chunks."""
    prompt = chat_prompts[2]
    req = greedy("r", prompt, logprobs=3, prompt_logprobs=2)
    outs = run_chunked(make_runner(), req, NUM_NEW, chunk=7)
    assert [o.prompt_logprobs for o in outs[:-NUM_NEW]] == [{}] * (len(outs) - NUM_NEW)  # until the first token
    scored = [o for o in outs if o.token_ids]
    assert len(scored) == NUM_NEW
    tokens = [o.token_ids[0] for o in scored]
    with torch.inference_mode():
        theirs = torch.log_softmax(hf_model(torch.tensor([prompt + tokens])).logits[0].float(), dim=-1)  # [n, V]
    n = len(prompt)
    for j, o in enumerate(scored):
        lp = o.logprobs["r"]
        assert lp.top_ids[0] == tokens[j] and len(lp.top_ids) == 3
        assert abs(lp.logprob - theirs[n - 1 + j, tokens[j]]) < 2e-3
        assert torch.allclose(torch.tensor(lp.top_logprobs), theirs[n - 1 + j, lp.top_ids], atol=2e-3)
    prompt_lps = scored[0].prompt_logprobs["r"]
    assert len(prompt_lps) == n - 1 and all(len(p.top_ids) == 2 for p in prompt_lps)
    want = theirs[torch.arange(n - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(torch.tensor([p.logprob for p in prompt_lps]), want, atol=2e-3)
    assert all(o.prompt_logprobs == {} for o in scored[1:])  # sent once


def test_a_plain_step_reports_no_logprobs(make_runner, chat_prompts):
    outs = run_chunked(make_runner(), greedy("r", chat_prompts[0]), 2, chunk=100)
    assert all(o.logprobs == {} and o.prompt_logprobs == {} for o in outs)


def _first_tokens(make_runner, prompt, num_new, **params) -> list[int]:
    return generate_together(make_runner(), [greedy("r", prompt, **params)], num_new)[0]


def _repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def test_penalties_and_bias_change_the_draw(make_runner, chat_prompts):
    prompt = chat_prompts[3]
    plain = _first_tokens(make_runner, prompt, 24)
    assert _repeats(plain) >= 5  # greedy repeats itself here ("we're going to talk about" twice)
    assert _repeats(_first_tokens(make_runner, prompt, 24, frequency_penalty=2.0)) < _repeats(plain)
    assert _repeats(_first_tokens(make_runner, prompt, 24, presence_penalty=2.0)) < _repeats(plain)
    # Repetition counts the prompt too: at 2 nothing repeats.
    assert _repeats(_first_tokens(make_runner, prompt, 24, repetition_penalty=2.0)) == 0
    # logit_bias -100 bans the greedy first token; +100 forces another one.
    banned = _first_tokens(make_runner, prompt, 3, logit_bias={plain[0]: -100.0})
    assert banned[0] != plain[0]
    assert _first_tokens(make_runner, prompt, 3, logit_bias={42: 100.0}) == [42] * 3


def test_processors_are_vllms_formulas():
    """Prompt [0, 1], outputs [1, 2, 2]: bias, then repetition over both, then frequency and
    presence over the outputs only."""
    row = torch.tensor([1.0, -1.0, 2.0, 4.0, 0.5])
    p = SamplingParams(
        max_tokens=8, logit_bias={4: 1.5}, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    process_row(row, p, [0, 1, 1, 2, 2], num_prompt=2)
    assert row.tolist() == [0.5, -2.0 - 0.5 - 0.25, 1.0 - 1.0 - 0.25, 4.0, 2.0]
    masked = torch.zeros(5)
    process_row(masked, SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[3]), [0, 1, 4], num_prompt=2)
    assert masked.tolist() == [0, 0, 0, float("-inf"), 0]  # one output so far: stop token 3 masked
    open_again = torch.zeros(5)
    process_row(open_again, SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[3]), [0, 1, 4, 4], 2)
    assert open_again.tolist() == [0.0] * 5


def test_min_tokens_masks_the_stop_tokens(make_runner, chat_prompts):
    """The greedy answer to "Hi!" ends early with a stop token; with min_tokens the stop
    tokens are masked until that many tokens are out, and then allowed again."""
    prompt = chat_prompts[1]
    plain = _first_tokens(make_runner, prompt, 40)
    eos = plain.index(2)  # <|im_end|>
    longer = _first_tokens(make_runner, prompt, eos + 8, stop_token_ids=[2], min_tokens=eos + 3)
    assert longer[:eos] == plain[:eos]
    assert 2 not in longer[: eos + 3]


def test_prompt_logprobs_survive_a_recompute_and_a_resubmission(make_runner, chat_prompts):
    """Preempted mid-prefill and recomputed from 0: the prompt is scored afresh, once, and
    equals an undisturbed run's. A resubmission that carries outputs (failover) has had its
    prompt's logprobs sent already: it sends none, and its next token's logprobs are the
    same as the undisturbed run's."""
    prompt = chat_prompts[2]
    n = len(prompt)
    undisturbed = run_chunked(make_runner(), greedy("r", prompt, logprobs=2, prompt_logprobs=1), 2, chunk=100)
    want = [o for o in undisturbed if o.token_ids]
    runner = make_runner()
    runner.add_requests([greedy("r", prompt, logprobs=2, prompt_logprobs=1)])
    table = list(range(blocks_for(n + 2)))
    assert runner.execute_step([ScheduledRequest("r", 0, n // 2, block_table=table)]).token_ids == []
    first = runner.execute_step([ScheduledRequest("r", 0, n, block_table=table)])  # the restart
    assert first.prompt_logprobs == want[0].prompt_logprobs and first.logprobs == want[0].logprobs
    again = make_runner()
    resubmitted = greedy("r", prompt, logprobs=2, prompt_logprobs=1)
    resubmitted.output_token_ids = list(first.token_ids)
    again.add_requests([resubmitted])
    second = again.execute_step([ScheduledRequest("r", 0, n + 1, block_table=table)])
    assert second.prompt_logprobs == {} and second.token_ids == want[1].token_ids
    assert abs(second.logprobs["r"].logprob - want[1].logprobs["r"].logprob) < 1e-4
