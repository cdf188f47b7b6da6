"""Our GGUF tokenizer against transformers' reading of the same file."""

from __future__ import annotations

import pytest

from shared.chat_template import ChatTemplateError
from shared.tokenizer import load_tokenizer

TEXTS = [
    "Hello world",
    "  leading spaces, trailing spaces   ",
    "naïve café déjà vu — Ünïcödé",
    "日本語のテキストと한국어",
    "emoji 🤖👍🏽👨‍👩‍👧 mixed",
    "def f(x):\n\treturn x ** 2  # square\n\n\nprint(f(12345))",
    "<|im_start|>user\nhi<|im_end|>\n",
    "numbers 3.14159 and 2026-11-29, 1,000,000",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 👋"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ],
]


@pytest.fixture(scope="module")
def hf_tokenizer(model_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_transformers(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode(text) == hf_tokenizer.encode(text)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(tokenizer, text):
    plain = text.replace("<|im_start|>", "").replace("<|im_end|>", "")  # special tokens are skipped
    assert tokenizer.decode(tokenizer.encode(text)) == plain


def test_digits_are_single_tokens(tokenizer):
    # llama.cpp's "smollm" pre-tokenizer: one token per digit
    assert len(tokenizer.encode("12345")) == 5


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_equals_transformers(tokenizer, hf_tokenizer, messages):
    ours = tokenizer.apply_chat_template(messages)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n")
    assert tokenizer.encode_chat(messages) == hf_tokenizer.encode(theirs)


def test_special_and_stop_tokens(tokenizer):
    assert tokenizer.eos_token_id == tokenizer.encode("<|im_end|>")[0] == 2
    assert 2 in tokenizer.stop_token_ids
    assert tokenizer.vocab_size == 49152
    assert tokenizer.encode("<|im_start|>") == [1]


def test_hf_directory_matches_gguf(tokenizer, hf_tokenizer, tmp_path):
    """A directory with tokenizer.json (as transformers writes it) loads to the same ids,
    template and stop tokens."""
    hf_tokenizer.save_pretrained(tmp_path)
    from_dir = load_tokenizer(tmp_path)
    for text in TEXTS:
        assert from_dir.encode(text) == tokenizer.encode(text)
    assert from_dir.apply_chat_template(CONVERSATIONS[1]) == tokenizer.apply_chat_template(CONVERSATIONS[1])
    assert from_dir.stop_token_ids == tokenizer.stop_token_ids


def test_template_raise_exception_is_a_value_error(tmp_path, hf_tokenizer):
    hf_tokenizer.save_pretrained(tmp_path)
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x"
    (tmp_path / "chat_template.jinja").write_text(template)
    tok = load_tokenizer(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == "x"
    with pytest.raises(ChatTemplateError, match="user first"):
        tok.apply_chat_template([{"role": "assistant", "content": "a"}])
