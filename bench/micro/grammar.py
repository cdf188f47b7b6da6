"""`superinfer bench grammar`: the grammar libraries that mask tokens for structured output,
side by side on our tokenizer: llguidance (what the worker uses), xgrammar, outlines-core.

Each library that is importable gets the bundled model's tokenizer (byte-level BPE, 49152
tokens) built from our own tokenizer data (no hub), then, for each JSON schema below:
- `compile_ms`: the schema to a grammar ready to mask, the first time (tokenizer-level
  setup, once per library, is `tokenizer_setup_ms`);
- `matcher_ms`: a fresh matcher from the compiled grammar (a request's own setup), median;
- the walk: a valid answer, encoded with our tokenizer, is fed token by token; at every
  step (and once more at the end, where a stop token must be allowed) the mask of allowed
  tokens is computed into an int32 bitmask (bit j of word w is token 32 w + j), as the
  worker does. `mask_ms`/`mask_p99_ms`: wall time of that call over all steps of all
  repetitions (`mask_cpu_*`: the thread's CPU time, which a busy machine does not inflate);
  `first_mask_ms`: the first step of the first walk (what a lazy library computes late).
- `refused`: the correctness check. None when every step's mask allowed the answer's next
  token (and a stop token at the end); otherwise the first step whose token was refused,
  where that walk stops. A timing counts only for a setup that passes.

Everything runs on one thread (`RAYON_NUM_THREADS=1`, xgrammar's `max_threads=1`).

    superinfer bench grammar --json bench/results/grammar_cpu.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.modelfile import resolve_model_path
from shared.tokenizer import ModelTokenizer, bytes_to_unicode, load_tokenizer


def _obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


# name -> (JSON schema, or None for json_object: any object; a valid answer, written compactly)
CASES: dict[str, tuple[dict | None, object]] = {
    "person": (
        _obj({"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}}),
        {"name": "Ada Lovelace", "age": 36},
    ),
    "enum": (
        _obj({"colour": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L", "XL"]}}),
        {"colour": "green", "size": "XL"},
    ),
    "list_of_objects": (
        _obj({"items": {"type": "array", "items": _obj({"name": {"type": "string"}, "qty": {"type": "integer"}})}}),
        {"items": [{"name": "apples", "qty": 6}, {"name": "bread", "qty": 1}, {"name": "milk", "qty": 2}]},
    ),
    "pattern": (
        _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
        {"code": "ABC-123"},
    ),
    "json_object": (None, {"id": 7, "tags": ["a", "b"], "owner": {"name": "Bo", "active": True}}),
}
LIBRARIES = ("llguidance", "xgrammar", "outlines-core")


@dataclass
class TokenizerData:
    """What each library is built from: our tokenizer, nothing downloaded."""

    json: str  # tokenizers' serialization (llguidance reads it whole)
    spellings: list[str]  # by id: the byte-level spelling ("Ġ" for a space); "" for a special token
    vocab_size: int
    eos_token_id: int
    stop_token_ids: list[int]

    @classmethod
    def from_tokenizer(cls, tok: ModelTokenizer) -> TokenizerData:
        text = tok.backend_json()
        data = json.loads(text)
        spellings = [""] * tok.vocab_size
        for spelling, i in data["model"]["vocab"].items():
            spellings[i] = spelling
        for added in data["added_tokens"]:
            spellings[added["id"]] = "" if added["special"] else added["content"]
        return cls(text, spellings, tok.vocab_size, tok.eos_token_id, list(tok.stop_token_ids))

    def token_bytes(self) -> list[bytes | None]:
        """By id: the bytes a token stands for; None for a special token."""
        decode = {c: b for b, c in bytes_to_unicode().items()}
        return [bytes(decode[c] for c in s) if s else None for s in self.spellings]


# ---------------------------------------------------------------- the three libraries
# Each: __init__(data) is the tokenizer-level setup; compile(schema) -> compiled grammar;
# matcher(compiled) -> a fresh matcher with fill(mask: [W] int32) and advance(token).


class LLGuidance:
    def __init__(self, data: TokenizerData) -> None:
        import llguidance

        self.ll = llguidance
        self.tokenizer = llguidance.LLTokenizer(data.json, eos_token=data.stop_token_ids)

    def compile(self, schema: dict) -> str:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        self.matcher(grammar)  # llguidance compiles the grammar with the tokenizer in the matcher
        return grammar

    def matcher(self, grammar: str) -> _LLMatcher:
        m = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return _LLMatcher(m)


class _LLMatcher:
    def __init__(self, m) -> None:
        self.m = m

    def fill(self, mask: torch.Tensor) -> None:
        self.m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * mask.element_size())

    def advance(self, token: int) -> None:
        if not self.m.consume_token(token):
            raise ValueError(self.m.get_error())


class XGrammar:
    def __init__(self, data: TokenizerData) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo(
            data.spellings,
            vocab_type=xgrammar.VocabType.BYTE_LEVEL,
            vocab_size=data.vocab_size,
            stop_token_ids=data.stop_token_ids,
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled) -> _XGMatcher:
        return _XGMatcher(self.xgr.GrammarMatcher(compiled))


class _XGMatcher:
    def __init__(self, m) -> None:
        self.m = m

    def fill(self, mask: torch.Tensor) -> None:
        self.m.fill_next_token_bitmask(mask.unsqueeze(0), 0)  # it takes [B, W]

    def advance(self, token: int) -> None:
        if not self.m.accept_token(token):
            raise ValueError(f"token {token} refused")


class OutlinesCore:
    """A regex built from the schema, indexed over the whole vocabulary at compile time.
    One EOS only: the tokenizer's."""

    def __init__(self, data: TokenizerData) -> None:
        import outlines_core

        self.oc = outlines_core
        tokens: dict[bytes, list[int]] = {}
        for i, b in enumerate(data.token_bytes()):
            if b is not None and i != data.eos_token_id:
                tokens.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(data.eos_token_id, tokens)

    def compile(self, schema: dict):
        from outlines_core.json_schema import build_regex_from_schema

        return self.oc.Index(build_regex_from_schema(json.dumps(schema)), self.vocabulary)

    def matcher(self, index) -> _OCMatcher:
        return _OCMatcher(self.oc.Guide(index))


class _OCMatcher:
    def __init__(self, guide) -> None:
        self.guide = guide

    def fill(self, mask: torch.Tensor) -> None:
        self.guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())

    def advance(self, token: int) -> None:
        self.guide.advance(token, return_tokens=False)


BACKENDS = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines-core": OutlinesCore}
_MODULES = {"llguidance": "llguidance", "xgrammar": "xgrammar", "outlines-core": "outlines_core"}


# ---------------------------------------------------------------- measuring


def _allowed(mask: torch.Tensor, token: int) -> bool:
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


def walk(backend, compiled, answer: list[int], stop_ids: list[int], mask: torch.Tensor):
    """One matcher fed `answer`, masking before every token and once at the end.
    Returns (wall seconds per mask, CPU seconds per mask, refused): refused is None or
    {"step", "token"} of the first token the mask did not allow (token None: no stop token
    allowed at the end)."""
    m = backend.matcher(compiled)
    walls, cpus = [], []
    for step in range(len(answer) + 1):
        mask.zero_()
        c0, t0 = time.thread_time(), time.perf_counter()
        m.fill(mask)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
        if step == len(answer):
            ok = any(_allowed(mask, s) for s in stop_ids)
            return walls, cpus, None if ok else {"step": step, "token": None}
        if not _allowed(mask, answer[step]):
            return walls, cpus, {"step": step, "token": answer[step]}
        m.advance(answer[step])
    raise AssertionError("unreachable")


def measure_case(
    backend, schema: dict, answer: list[int], data: TokenizerData, repeats: int, samples: list[float] | None = None
) -> dict:
    """`samples`, when given, also receives every mask's wall time (the library's summary)."""
    mask = torch.zeros((data.vocab_size + 31) // 32, dtype=torch.int32)  # [W]
    t0 = time.perf_counter()
    compiled = backend.compile(schema)
    compile_ms = (time.perf_counter() - t0) * 1e3
    walls, cpus, matcher_s, refused, first = [], [], [], None, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        backend.matcher(compiled)
        matcher_s.append(time.perf_counter() - t0)
        w, c, refused = walk(backend, compiled, answer, data.stop_token_ids, mask)
        first = w[0] if first is None else first
        walls += w
        cpus += c
        if refused is not None:
            break
    if samples is not None:
        samples += walls
    return {
        "compile_ms": round(compile_ms, 3),
        "matcher_ms": _ms(statistics.median(matcher_s)),
        "first_mask_ms": _ms(first),
        "mask_ms": _ms(statistics.median(walls)),
        "mask_p99_ms": _ms(_p99(walls)),
        "mask_cpu_ms": _ms(statistics.median(cpus)),
        "mask_cpu_p99_ms": _ms(_p99(cpus)),
        "steps": len(answer) + 1,
        "masks_timed": len(walls),
        "refused": refused,
    }


def run_library(name: str, data: TokenizerData, cases: dict[str, tuple[dict | None, list[int]]], repeats: int) -> dict:
    """cases: name -> (schema or None for json_object, answer token ids)."""
    try:
        importlib.import_module(_MODULES[name])
    except ImportError as e:
        return {"skipped": f"not installed ({e})"}
    t0 = time.perf_counter()
    backend = BACKENDS[name](data)
    result = {
        "version": importlib.metadata.version(name),
        "tokenizer_setup_ms": round((time.perf_counter() - t0) * 1e3, 1),
        "cases": {},
    }
    walls: list[float] = []
    for case, (schema, answer) in cases.items():
        try:
            result["cases"][case] = measure_case(backend, schema or {"type": "object"}, answer, data, repeats, walls)
        except Exception as e:  # a schema this library cannot take is a result, not a crash
            result["cases"][case] = {"error": f"{type(e).__name__}: {e}"[:300]}
    if walls:  # every mask of every case
        result["all_cases"] = {"mask_ms": _ms(statistics.median(walls)), "mask_p99_ms": _ms(_p99(walls))}
    return result


def _p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98] if len(xs) >= 2 else xs[0]


def _ms(s: float) -> float:
    return round(s * 1e3, 4)


def format_table(results: dict) -> str:
    head = f"{'library':<14} {'case':<16} {'compile ms':>10} {'matcher ms':>10} {'1st mask':>9} {'mask ms':>8} {'p99 ms':>8} {'steps':>5}  check"
    lines = [head, "-" * len(head)]
    for name, lib in results["libraries"].items():
        if "skipped" in lib:
            lines.append(f"{name:<14} skipped: {lib['skipped']}")
            continue
        summary = lib.get("all_cases", {})
        lines.append(
            f"{name:<14} {lib['version']}, tokenizer setup {lib['tokenizer_setup_ms']:.0f} ms; all cases:"
            f" mask {summary.get('mask_ms', float('nan')):.4f} ms median, {summary.get('mask_p99_ms', float('nan')):.4f} ms p99"
        )
        for case, r in lib["cases"].items():
            if "error" in r:
                lines.append(f"{'':<14} {case:<16} error: {r['error'][:80]}")
                continue
            check = "ok" if r["refused"] is None else f"REFUSED at step {r['refused']['step']}"
            lines.append(
                f"{'':<14} {case:<16} {r['compile_ms']:>10.2f} {r['matcher_ms']:>10.3f} {r['first_mask_ms']:>9.3f}"
                f" {r['mask_ms']:>8.4f} {r['mask_p99_ms']:>8.4f} {r['steps']:>5}  {check}"
            )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled model)")
    parser.add_argument("--libraries", default=",".join(LIBRARIES), help="comma list of " + ", ".join(LIBRARIES))
    parser.add_argument("--cases", default=",".join(CASES), help="comma list of " + ", ".join(CASES))
    parser.add_argument("--repeats", type=int, default=20, help="walks of each answer (fresh matcher each)")
    parser.add_argument("--json", type=Path, default=Path("bench/results/grammar_cpu.json"), help="write the results here")


def run(args: argparse.Namespace) -> int:
    os.environ["RAYON_NUM_THREADS"] = "1"  # before any Rust library starts its pool
    torch.set_num_threads(1)
    unknown = set(args.libraries.split(",")) - set(LIBRARIES) | set(args.cases.split(",")) - set(CASES)
    if unknown:
        raise SystemExit(f"unknown libraries or cases: {', '.join(sorted(unknown))}")
    tok = load_tokenizer(resolve_model_path(args.model))
    data = TokenizerData.from_tokenizer(tok)
    cases = {}
    for case in args.cases.split(","):
        schema, answer = CASES[case]
        cases[case] = (schema, tok.encode(json.dumps(answer, separators=(",", ":")), add_special_tokens=False))
    results = {
        "setup": {"vocab_size": data.vocab_size, "threads": 1, "repeats": args.repeats, "torch": torch.__version__},
        "libraries": {name: run_library(name, data, cases, args.repeats) for name in args.libraries.split(",")},
    }
    print(format_table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    refused = any(r.get("refused") for lib in results["libraries"].values() for r in lib.get("cases", {}).values())
    return 1 if refused else 0  # a library that refused a valid answer: its timings do not count
