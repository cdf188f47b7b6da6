"""The model runner: a Plan's scheduled requests in, one sampled token per finished row out.

It keeps, per request, the tokens known so far (prompt + outputs), the HBM block table
and the sampling state; the scheduler sends only diffs. Each `execute` runs ONE forward
over all scheduled tokens and samples the requests whose computed tokens reach the end of
their known tokens. It never decides anything: which tokens, which blocks, is the Plan's.

Under tensor parallelism every rank runs one runner over its shard with the same plans; only
rank 0 computes logits and samples, and the others take its token ids (tp.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.worker.attention import build_metadata
from services.worker.grammar import Constraint, GrammarCompiler, mask_rows
from services.worker.host_memory import huge_page_host_tensor
from services.worker.logits import process_row, raw_logprobs, token_logprobs, wants_processing
from services.worker.model import LlamaModel
from services.worker.sampler import draw_seed, is_greedy, make_generator, request_seed, sample
from services.worker.tp import TPGroup, shard_config, shard_weights
from services.worker.weights import load_weights
from shared.modelfile import ModelConfig, read_model_config
from shared.protocol import NewRequestData, SamplingParams, ScheduledRequest, TokenLogprobs


def load_model(
    path: Path, device: torch.device | str, dtype: torch.dtype | str = torch.float32, group: TPGroup | None = None
) -> tuple[LlamaModel, ModelConfig]:
    """Our model with the weights at `path` (GGUF file or HF directory), ready for inference.

    With a tensor-parallel `group`: this rank's shard, and the config of that shard (its
    heads, KV heads and MLP rows), which is what the runner and the KV pools are sized by."""
    cfg = read_model_config(Path(path))
    # A quantization's name (weights.QUANT_CHOICES): its matrices packed, all else float32.
    quant = None if isinstance(dtype, torch.dtype) or group is not None else dtype
    dtype = torch.float32 if isinstance(dtype, str) else dtype
    weights = load_weights(Path(path), cfg, quant)
    if group is None:
        return LlamaModel(cfg, weights, device=device, dtype=dtype).eval(), cfg
    cfg = shard_config(cfg, group.num_ranks)
    weights = shard_weights(weights, group.rank, group.num_ranks)
    return LlamaModel(cfg, weights, device=device, dtype=dtype, all_reduce=group.all_reduce).eval(), cfg


def kv_block_shape(cfg: ModelConfig, block_size: int) -> tuple[int, ...]:
    """Shape of one block of the pool: every layer's K and V for `block_size` tokens."""
    return (cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)


def allocate_kv_pool(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """[num_blocks, num_layers, 2, block_size, KV, D], zeroed (on CPU in huge pages where the kernel
    gives them, as the worker's pools: kv_pool.py)."""
    shape = (num_blocks, *kv_block_shape(cfg, block_size))
    if torch.device(device).type == "cpu":
        return huge_page_host_tensor(shape, dtype).zero_()
    return torch.zeros(shape, dtype=dtype, device=device)


@dataclass
class _Request:
    token_ids: list[int]  # prompt + outputs so far
    params: SamplingParams
    generator: torch.Generator | None
    seed: int
    block_table: list[int]
    num_prompt: int
    processed: bool  # a logit processor applies (logits.wants_processing)
    # Prompt logprobs still to be scored (asked, and not yet sent with a first token), and
    # those scored so far, one per prompt token from the second on.
    scores_prompt: bool
    # Anything beyond plain sampling: logprobs, prompt logprobs, a processor or a grammar
    # (fixed at add).
    asks: bool
    constraint: Constraint | None = None  # structured output (only where this rank samples)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass
class StepTokens:
    """One step's results: a sampled token per request that reached the end of its known
    tokens, in plan order; logprobs only for the requests that asked."""

    request_ids: list[str]
    token_ids: list[int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


class ModelRunner:
    """Executes the scheduled part of each Plan against one KV pool (the worker's HBM tier).

    Block tables arrive as diffs: `ScheduledRequest.new_block_ids` are appended to the
    request's table; `block_table`, when set, first replaces the whole table (after a
    swap-in or a recompute restart), and any `new_block_ids` are appended after it.
    """

    def __init__(
        self,
        model: LlamaModel,
        cfg: ModelConfig,
        kv_pool: torch.Tensor,
        block_size: int,
        device,
        group: TPGroup | None = None,
        grammars: GrammarCompiler | None = None,
    ):
        want = kv_block_shape(cfg, block_size)
        if tuple(kv_pool.shape[1:]) != want:
            raise ValueError(f"kv_pool blocks are {tuple(kv_pool.shape[1:])}, the model needs {want}")
        dtype = next(model.parameters()).dtype
        if not kv_pool.dtype.is_floating_point or kv_pool.dtype.itemsize > dtype.itemsize:
            raise ValueError(f"kv_pool is {kv_pool.dtype}: the model computes in {dtype}, the KV may be narrower")
        self.model = model
        self.cfg = cfg
        self.kv_pool = kv_pool
        self.block_size = block_size
        self.device = torch.device(device)
        self.group = group
        self.grammars = grammars  # needed for requests with a grammar
        self._requests: dict[str, _Request] = {}
        self._num_asking = 0  # requests whose `asks`: while 0, a step is plain sampling

    # ------------------------------------------------------------ request state

    def add_requests(self, new: list[NewRequestData]) -> None:
        for r in new:
            if r.request_id in self._requests:
                raise ValueError(f"request {r.request_id!r} is already known")
            p = r.params
            processed = wants_processing(p)
            req = self._requests[r.request_id] = _Request(
                token_ids=list(r.prompt_token_ids) + list(r.output_token_ids),
                params=p,
                generator=make_generator(p, self.device),
                seed=request_seed(p),
                block_table=[],
                num_prompt=len(r.prompt_token_ids),
                processed=processed,
                # A resubmission with outputs already sent its prompt's logprobs with the first.
                scores_prompt=p.prompt_logprobs is not None and not r.output_token_ids,
                asks=processed or p.logprobs is not None or p.prompt_logprobs is not None or p.grammar is not None,
                constraint=self._constraint(r),
            )
            self._num_asking += req.asks

    def _constraint(self, r: NewRequestData) -> Constraint | None:
        if r.params.grammar is None or not (self.group is None or self.group.is_driver):
            return None
        if self.grammars is None:
            raise ValueError(f"request {r.request_id!r} has a grammar and this runner has no GrammarCompiler")
        return self.grammars.constraint(r.params.grammar, r.request_id, r.output_token_ids)

    def drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            req = self._requests.pop(rid, None)
            if req is not None:
                self._num_asking -= req.asks

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def extent(self, request_id: str) -> tuple[int, int] | None:
        """(tokens known, block table length) of a request held here, else None (plan_check.py)."""
        r = self._requests.get(request_id)
        return None if r is None else (len(r.token_ids), len(r.block_table))

    def token_ids(self, request_id: str) -> list[int]:
        """Prompt + outputs known for the request (a copy)."""
        return list(self._requests[request_id].token_ids)

    def blocks_touched(self, scheduled: list[ScheduledRequest]) -> set[int]:
        """HBM blocks that executing `scheduled` reads or writes (block-table changes
        included), so a transfer of a later plan can tell whether it must wait."""
        out: set[int] = set()
        for s in scheduled:
            req = self._requests.get(s.request_id)
            table = s.block_table if s.block_table is not None else (req.block_table if req else [])
            out.update(table)
            out.update(s.new_block_ids)
        return out

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------ undoing a failed step

    def checkpoint(self, scheduled: list[ScheduledRequest]) -> dict[str, tuple]:
        """What a step may change of its scheduled requests, for `rollback` should it raise:
        a re-run then starts from the same state (no token, block or logprob added twice)."""
        saved = {}
        for s in scheduled:
            if (r := self._requests.get(s.request_id)) is not None:
                saved[s.request_id] = (len(r.token_ids), list(r.block_table), r.scores_prompt, list(r.prompt_logprobs))
        return saved

    def rollback(self, saved: dict[str, tuple]) -> None:
        """Back to `checkpoint`'s state. A grammar's matcher is rebuilt from the outputs kept
        (it may have consumed a token the step never appended)."""
        for rid, (num_tokens, table, scores_prompt, prompt_logprobs) in saved.items():
            if (r := self._requests.get(rid)) is None:
                continue
            del r.token_ids[num_tokens:]
            r.block_table, r.scores_prompt, r.prompt_logprobs = table, scores_prompt, prompt_logprobs
            if r.constraint is not None:
                r.constraint = self.grammars.constraint(r.params.grammar, rid, r.token_ids[r.num_prompt :])

    # ------------------------------------------------------------ one step

    def execute(self, scheduled: list[ScheduledRequest]) -> tuple[list[str], list[int]]:
        """Run one step; returns (request ids, sampled token ids) in the order of `scheduled`."""
        out = self.execute_step(scheduled)
        return out.request_ids, out.token_ids

    def execute_step(self, scheduled: list[ScheduledRequest]) -> StepTokens:
        """Run one step: `execute`, with the logprobs of the requests that asked."""
        if not scheduled:
            return StepTokens([], [])
        _check_unique(scheduled)
        for s in scheduled:
            self._apply_block_changes(s)
        # Single-token queries first: attention batches them in one call.
        step = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)
        reqs = [self._requests[s.request_id] for s in step]
        token_ids, positions, sample_rows, sampled = self._inputs(step, reqs)
        chosen = [reqs[i] for i in sampled]
        samples_here = self.group is None or self.group.is_driver
        scored = self._prompt_rows(step, reqs) if self._num_asking and samples_here else []
        logit_rows = sample_rows + [row for _, row, _ in scored] if samples_here else []
        out = StepTokens([], [])
        chosen_ids = [step[i].request_id for i in sampled]
        new_tokens = None
        if len(token_ids) == len(step):  # decodes alone: the model's `decode` (one native call where it applies)
            pick = samples_here and not self._num_asking and all(is_greedy(reqs[i].params) for i in sample_rows)
            tables = [r.block_table for r in reqs]
            logits, new_tokens = self.model.decode(self.kv_pool, token_ids, positions, tables, logit_rows, pick)
            if new_tokens is None and samples_here:
                new_tokens = self._tokens(logits, len(sample_rows), scored, chosen, chosen_ids, out)
        else:
            with torch.inference_mode():
                logits = self._forward(step, reqs, token_ids, positions, logit_rows)  # [S + P, V]
                if samples_here:
                    new_tokens = self._tokens(logits, len(sample_rows), scored, chosen, chosen_ids, out)
        if self.group is not None:
            new_tokens = self.group.broadcast_tokens(new_tokens, len(chosen))
        for r, t in zip(chosen, new_tokens):
            r.token_ids.append(t)
        by_request = {step[i].request_id: t for i, t in zip(sampled, new_tokens)}
        out.request_ids = [s.request_id for s in scheduled if s.request_id in by_request]
        out.token_ids = [by_request[rid] for rid in out.request_ids]
        return out

    def _tokens(self, logits, num_samples: int, scored, chosen: list[_Request], ids: list[str], out: StepTokens):
        """logits: [S + P, V], the rows that sample then those that score a prompt token."""
        if scored:
            self._score_prompts(logits[num_samples:], scored)
            logits = logits[:num_samples]
        return self._sample(logits, chosen, ids, out)

    def _sample(self, logits: torch.Tensor, chosen: list[_Request], ids: list[str], out: StepTokens) -> list[int]:
        """logits: [S, V], one row per chosen request (processed in place for those that
        ask); the logprobs of those that ask go into `out`."""
        asking = [i for i, r in enumerate(chosen) if r.asks] if self._num_asking else []
        constrained = [i for i in asking if chosen[i].constraint is not None]
        if constrained:  # first: logprobs and processors see the constrained distribution
            mask_rows(logits, constrained, [chosen[i].constraint for i in constrained])
        want_logprobs = [i for i in asking if chosen[i].params.logprobs is not None]
        raw = raw_logprobs(logits[want_logprobs]) if want_logprobs else None  # before any processing
        for i in asking:
            r = chosen[i]
            if r.processed:
                process_row(logits[i], r.params, r.token_ids, r.num_prompt)
        tokens = sample(
            logits,
            [r.params for r in chosen],
            [r.generator for r in chosen],
            [draw_seed(r.seed, len(r.token_ids)) for r in chosen],
        )
        if raw is not None:
            ks = [chosen[i].params.logprobs for i in want_logprobs]
            for i, lp in zip(want_logprobs, token_logprobs(raw, [tokens[i] for i in want_logprobs], ks)):
                out.logprobs[ids[i]] = lp
        for i in constrained:
            chosen[i].constraint.advance(tokens[i])
        for i in asking:
            r = chosen[i]
            if r.scores_prompt:  # its prompt is complete: send what was scored, once
                out.prompt_logprobs[ids[i]] = r.prompt_logprobs
                r.scores_prompt, r.prompt_logprobs = False, []
        return tokens

    def _prompt_rows(self, step: list[ScheduledRequest], reqs: list[_Request]) -> list[tuple[_Request, int, int]]:
        """(request, row of the flattened step, the prompt token that row's logits predict)
        for every prompt position this step computes whose next token is a prompt token,
        of the requests that still score their prompt."""
        out = []
        base = 0
        for s, r in zip(step, reqs):
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            if r.scores_prompt:
                if start == 0:
                    r.prompt_logprobs = []  # a recompute restart scores the prompt afresh
                out += [(r, base + p - start, r.token_ids[p + 1]) for p in range(start, min(end, r.num_prompt - 1))]
            base += end - start
        return out

    def _score_prompts(self, logits: torch.Tensor, scored: list[tuple[_Request, int, int]]) -> None:
        """logits: [P, V], one row per entry of `scored`, in order."""
        ks = [r.params.prompt_logprobs for r, _, _ in scored]
        lps = token_logprobs(raw_logprobs(logits), [t for _, _, t in scored], ks)
        for (r, _, _), lp in zip(scored, lps):
            r.prompt_logprobs.append(lp)

    def _forward(self, step, reqs, token_ids, positions, sample_rows) -> torch.Tensor:
        meta = build_metadata(
            [s.num_computed_tokens for s in step],
            [s.num_new_tokens for s in step],
            [r.block_table for r in reqs],
            self.block_size,
            self.device,
        )
        return self.model(
            torch.tensor(token_ids, dtype=torch.long).to(self.device),
            torch.tensor(positions, dtype=torch.long).to(self.device),
            meta,
            self.kv_pool,
            torch.tensor(sample_rows, dtype=torch.long).to(self.device),
        )

    def _apply_block_changes(self, s: ScheduledRequest) -> None:
        """`block_table`, when set, is the whole new table; `new_block_ids` are then appended."""
        req = self._requests.get(s.request_id)
        if req is None:
            raise KeyError(f"scheduled request {s.request_id!r} is unknown to the worker")
        if s.block_table is not None:
            req.block_table = list(s.block_table)
        req.block_table.extend(s.new_block_ids)

    def _inputs(self, step: list[ScheduledRequest], reqs: list[_Request]):
        """Flattened token ids and positions, the rows that sample, and which requests they are."""
        token_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sampled: list[int] = []
        for i, (s, r) in enumerate(zip(step, reqs)):
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            if s.num_new_tokens < 1 or start < 0 or end > len(r.token_ids):
                raise ValueError(
                    f"request {s.request_id!r}: tokens [{start}, {end}) outside the {len(r.token_ids)} known"
                )
            token_ids.extend(r.token_ids[start:end])
            positions.extend(range(start, end))
            if end == len(r.token_ids):
                sample_rows.append(len(token_ids) - 1)
                sampled.append(i)
        return token_ids, positions, sample_rows, sampled


def _check_unique(scheduled: list[ScheduledRequest]) -> None:
    ids = [s.request_id for s in scheduled]
    if len(set(ids)) != len(ids):
        raise ValueError("a request is scheduled twice in one step")
