"""The model's tokenizer and chat template, built from what ships with the weights.

A GGUF carries no tokenizer.json: its vocabulary, merges, special tokens and chat template
live in metadata under llama.cpp's key names, so the byte-level BPE is rebuilt here from
those. A Hugging Face-style directory brings tokenizer.json and tokenizer_config.json.
Either way the gateway gets one small object; nothing else in the service touches the
`tokenizers` library.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from shared.chat_template import ChatTemplate
from shared.modelfile import gguf_header, is_gguf

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

# Tokens that end an assistant turn in the chat formats we know; each one present in the
# vocabulary stops generation in addition to EOS.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

# How llama.cpp's `tokenizer.ggml.pre` types split text before BPE (the regex the merges were
# learned with). Types not listed use GPT-2's own regex inside the ByteLevel pre-tokenizer.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_DIGIT_SPLIT = {"smollm", "starcoder"}  # one token per digit, then GPT-2's regex


class ModelTokenizer:
    """Text <-> token ids, the stop tokens, and the chat template of one model."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_token_id: int | None,
        chat_template: str | None,
        special_tokens: dict[str, str],
        extra_stop_ids: tuple[int, ...] = (),
    ) -> None:
        self._tok = tokenizer
        self.eos_token_id = eos_token_id
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.stop_token_ids = _stop_ids(tokenizer, eos_token_id, extra_stop_ids)
        self._template = ChatTemplate(chat_template, special_tokens) if chat_template else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special tokens written in the text (e.g. `<|im_start|>`) become their ids;
        `add_special_tokens` adds the BOS the model expects, when it expects one."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's token as the vocabulary writes it (byte-level BPE: `Ġ` for a space)."""
        return [self._tok.id_to_token(i) for i in ids]

    def backend_json(self) -> str:
        """The whole tokenizer as `tokenizers` serializes it (what llguidance reads)."""
        return self._tok.to_str()

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @property
    def template_knows_tools(self) -> bool:
        return self._template is not None and self._template.knows_tools

    @property
    def tool_call_format(self) -> str | None:
        """The tool-call format the chat template writes, by vLLM's `--tool-call-parser`
        name: "hermes" (`<tool_call>` JSON, Qwen2.5 and Hermes), "llama3_json" (Llama 3.1's
        JSON); None for a template that knows no tools."""
        source = "" if self._template is None else self._template.source
        if "<tool_call>" in source:
            return "hermes"
        if "<|python_tag|>" in source or ("<|start_header_id|>" in source and "tools" in source):
            return "llama3_json"
        return None

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt text for a conversation, ending where the assistant's reply begins.
        Raises `ValueError` when the model has no template or the template rejects the
        conversation (e.g. roles out of order)."""
        if self._template is None:
            raise ValueError("this model has no chat template; use /v1/completions")
        return self._template.render(messages, tools=tools)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The template writes BOS itself where the model wants one, so none is added."""
        return self.encode(self.apply_chat_template(messages, tools), add_special_tokens=False)


def load_tokenizer(path: Path) -> ModelTokenizer:
    return _from_gguf(path) if is_gguf(path) else _from_hf_dir(path)


# ---------------------------------------------------------------- GGUF


def _from_gguf(path: Path) -> ModelTokenizer:
    f = gguf_header(path).fields
    kind = f.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer {kind!r} is not supported (byte-level BPE 'gpt2' is)")
    tokens: list[str] = list(f["tokenizer.ggml.tokens"])
    types: list[int] = list(f.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    tok = _byte_level_bpe(tokens, list(f["tokenizer.ggml.merges"]), f.get("tokenizer.ggml.pre"))
    _add_gguf_special_tokens(tok, tokens, types)
    bos = _token_at(tokens, f.get("tokenizer.ggml.bos_token_id"))
    eos = _token_at(tokens, f.get("tokenizer.ggml.eos_token_id"))
    if f.get("tokenizer.ggml.add_bos_token") and bos is not None:
        bos_id = int(f["tokenizer.ggml.bos_token_id"])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)]
        )
    eos_id = f.get("tokenizer.ggml.eos_token_id")
    specials = {"bos_token": bos or "", "eos_token": eos or ""}
    return ModelTokenizer(tok, None if eos_id is None else int(eos_id), f.get("tokenizer.chat_template"), specials)


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> Tokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token spelled outside the byte alphabet (a real space, say) is re-spelled byte by byte.
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def _pre_tokenizer(pre: str | None):
    if pre in _PRE_SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _add_gguf_special_tokens(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens stay whole and are skipped when decoding; user-defined ones stay whole
    but are ordinary text. A control token spelled outside the byte alphabet is a mislabel
    in some files and is left alone."""
    alphabet = set(bytes_to_unicode().values())
    control = [t for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= alphabet]
    user = [t for t, k in zip(tokens, types) if k == _USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used to spell byte-level tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


def _token_at(tokens: list[str], index) -> str | None:
    return None if index is None or not 0 <= int(index) < len(tokens) else tokens[int(index)]


# ---------------------------------------------------------------- Hugging Face directory


def _from_hf_dir(path: Path) -> ModelTokenizer:
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    cfg = _read_json(path / "tokenizer_config.json")
    specials = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    eos = specials["eos_token"]
    eos_id = tok.token_to_id(eos) if eos else None
    gen = _read_json(path / "generation_config.json").get("eos_token_id")
    extra = tuple(gen if isinstance(gen, list) else [] if gen is None else [gen])
    return ModelTokenizer(tok, eos_id, _hf_chat_template(path, cfg), specials, extra)


def _hf_chat_template(path: Path, cfg: dict) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template


def _token_text(value) -> str:
    if isinstance(value, dict):  # serialized AddedToken
        return value.get("content", "")
    return value or ""


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _stop_ids(tok: Tokenizer, eos_id: int | None, extra: tuple[int, ...]) -> list[int]:
    ids = [] if eos_id is None else [eos_id]
    ids += [int(i) for i in extra]
    ids += [i for t in _END_OF_TURN if (i := tok.token_to_id(t)) is not None]
    return sorted(set(ids))
