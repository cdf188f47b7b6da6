"""`bench grammar`: llguidance on one small schema (the other libraries are not dependencies),
the table and JSON it writes, and a correctness check that catches a refused token."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.micro import grammar


@pytest.fixture(scope="module")
def data(tokenizer) -> grammar.TokenizerData:
    return grammar.TokenizerData.from_tokenizer(tokenizer)


def test_tokenizer_data_spells_every_token(tokenizer, data):
    assert len(data.spellings) == data.vocab_size == 49152
    as_bytes = data.token_bytes()
    ids = tokenizer.encode('{"name":"Ada"}', add_special_tokens=False)
    assert b"".join(as_bytes[i] for i in ids) == b'{"name":"Ada"}'
    assert all(as_bytes[i] is None for i in data.stop_token_ids)  # specials stand for no text


def test_llguidance_walks_a_valid_answer(tokenizer, data):
    schema, answer = grammar.CASES["person"]
    ids = tokenizer.encode(json.dumps(answer, separators=(",", ":")), add_special_tokens=False)
    r = grammar.measure_case(grammar.LLGuidance(data), schema, ids, data, repeats=2)
    assert r["refused"] is None
    assert r["steps"] == len(ids) + 1 and r["masks_timed"] == 2 * r["steps"]
    assert 0 < r["mask_ms"] <= r["mask_p99_ms"] and r["compile_ms"] > 0


def test_a_token_the_grammar_forbids_is_reported(tokenizer, data):
    schema, _ = grammar.CASES["person"]
    good = tokenizer.encode('{"name":"Ada","age":', add_special_tokens=False)
    bad = good + tokenizer.encode('"36"}', add_special_tokens=False)  # age must be an integer
    r = grammar.measure_case(grammar.LLGuidance(data), schema, bad, data, repeats=2)
    assert r["refused"] == {"step": len(good), "token": bad[len(good)]}
    assert r["masks_timed"] == len(good) + 1  # the walk stops at the refusal, once
    # An answer cut short: no stop token is allowed where the JSON is not complete.
    r = grammar.measure_case(grammar.LLGuidance(data), schema, good, data, repeats=1)
    assert r["refused"] == {"step": len(good), "token": None}


def test_run_writes_the_table_and_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(grammar._MODULES, "xgrammar", "xgrammar_not_here")  # as where it is not installed
    parser = argparse.ArgumentParser()
    grammar.add_arguments(parser)
    out = tmp_path / "grammar.json"
    args = parser.parse_args(["--libraries", "llguidance,xgrammar", "--cases", "enum", "--repeats", "2", "--json", str(out)])
    assert grammar.run(args) == 0
    results = json.loads(out.read_text())
    assert results["setup"]["vocab_size"] == 49152 and results["setup"]["threads"] == 1
    lib = results["libraries"]["llguidance"]
    assert set(lib) == {"version", "tokenizer_setup_ms", "cases", "all_cases"}
    assert lib["all_cases"]["mask_ms"] <= lib["all_cases"]["mask_p99_ms"]
    case = lib["cases"]["enum"]
    assert case["refused"] is None
    assert set(case) >= {"compile_ms", "matcher_ms", "first_mask_ms", "mask_ms", "mask_p99_ms", "steps", "refused"}
    assert "not installed" in results["libraries"]["xgrammar"]["skipped"]
    table = capsys.readouterr().out
    assert "llguidance" in table and "enum" in table and " ok" in table and "xgrammar" in table and "skipped" in table
