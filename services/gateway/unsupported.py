"""Request fields we know and do not implement: each is refused with a 400 naming it, unless
its value asks for nothing (null, or the no-op default clients send anyway, such as
`"best_of": 1` or `"function_call": "none"`). None is accepted and dropped.

The structs in api.py declare these fields (type `Refused`, any JSON), so that the body is
decoded once; `refusal` is the check `decode_request` runs on the decoded request. The fields
that ask nothing of the output (`user`, `metadata`, `safety_identifier`, the prompt-cache
hints) are accepted, not listed here. Fields nobody documents are ignored, as OpenAI does.
"""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta

from services.gateway.errors import ApiError, bad_request

# Field -> the values (besides null) that ask for nothing. OpenAI's first, then vLLM's
# extensions that change the output.
NO_OP: dict[str, tuple] = {
    # sampling and scoring
    "best_of": (1,),
    "suffix": ("",),
    # output formats, tools and other products
    "functions": ([],),
    "function_call": ("none",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
    "moderation": (),
    "store": (False,),
    "service_tier": ("auto", "default"),
    # vLLM's sampling extensions
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
}

Refused = Annotated[Any, Meta(description="not implemented: refused (400) unless null or its no-op default")]


def _same(value: Any, default: Any) -> bool:
    """JSON equality: 0 and 0.0 are the same number, but false is not 0."""
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    if isinstance(value, (int, float)) and isinstance(default, (int, float)):
        return value == default
    return type(value) is type(default) and value == default


def is_no_op(name: str, value: Any, table: dict[str, tuple] = NO_OP) -> bool:
    return value is None or any(_same(value, d) for d in table.get(name, ()))


def refused_fields(struct_type: type) -> tuple[str, ...]:
    """The fields of a request struct that `refusal` checks."""
    return tuple(f for f in struct_type.__struct_fields__ if f in NO_OP)


def refusal(req, fields: tuple[str, ...], table: dict[str, tuple] = NO_OP) -> ApiError | None:
    """A 400 naming the first of `fields` that asks for something we do not implement
    (`table`: each field's no-op values besides null)."""
    for name in fields:
        value = getattr(req, name)
        if not is_no_op(name, value, table):
            return bad_request(f"{name} is not supported by this server", param=name, code="unsupported_parameter")
    return None
