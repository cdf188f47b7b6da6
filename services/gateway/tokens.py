"""`POST /tokenize` and `POST /detokenize`, in vLLM's shapes:

    /tokenize    {model?, prompt | messages, add_special_tokens?, return_token_strs?}
                 -> {tokens, count, max_model_len, token_strs}
    /detokenize  {model?, tokens} -> {prompt}

A prompt is tokenized as /v1/completions does (BOS added by default), messages as
/v1/chat/completions does (through the chat template, which writes BOS itself, so
`add_special_tokens` defaults to false). Detokenizing keeps special tokens, as vLLM does,
so that a templated prompt comes back as the text it was. Pure functions; the routes are
in app.py.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from services.gateway.api import ChatMessage, Tool
from services.gateway.errors import bad_request, from_validation
from services.gateway.params import render_chat
from services.gateway.tools import tool_dicts
from services.gateway.unsupported import Refused, refusal
from shared.tokenizer import ModelTokenizer


class TokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    return_token_strs: bool = False
    # vLLM's options of the chat form that we do not implement (our template always ends
    # where the assistant's reply begins).
    add_generation_prompt: Refused = None
    continue_final_message: Refused = None
    chat_template: Refused = None
    chat_template_kwargs: Refused = None
    tools: list[Tool] | None = None  # written into the prompt as /v1/chat/completions writes them


class TokenizeResponse(Struct):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class DetokenizeRequest(Struct, kw_only=True):
    tokens: list[Annotated[int, Meta(ge=0)]]
    model: str | None = None


class DetokenizeResponse(Struct):
    prompt: str


# add_generation_prompt: true and continue_final_message: false are what our template does.
_TOKENIZE_NO_OP = {"add_generation_prompt": (True,), "continue_final_message": (False,)}
_decoders = {t: msgspec.json.Decoder(t) for t in (TokenizeRequest, DetokenizeRequest)}


def decode(body: bytes, type: type):
    try:
        req = _decoders[type].decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise from_validation(e) from None
    if type is TokenizeRequest:
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give either prompt or messages", param="prompt")
        fields = ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs")
        if (e := refusal(req, fields, _TOKENIZE_NO_OP)) is not None:
            raise e
    return req


def tokenize(req: TokenizeRequest, tok: ModelTokenizer, max_model_len: int, tool_format: str = "hermes") -> TokenizeResponse:
    if req.messages is not None:
        try:
            text = render_chat(req.messages, tool_dicts(req.tools), tool_format, tok)
        except ValueError as e:
            raise bad_request(str(e), param="messages") from None
        ids = tok.encode(text, add_special_tokens=bool(req.add_special_tokens))
    else:
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    strs = tok.token_strs(ids) if req.return_token_strs else None
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=max_model_len, token_strs=strs)


def detokenize(req: DetokenizeRequest, tok: ModelTokenizer) -> DetokenizeResponse:
    bad = next((t for t in req.tokens if t >= tok.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (0..{tok.vocab_size - 1})", param="tokens")
    return DetokenizeResponse(prompt=tok.decode(req.tokens, skip_special_tokens=False))
