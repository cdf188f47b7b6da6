"""Rendering a model's Jinja chat template the way the model's authors do.

Templates come from model files, which are untrusted input: they run in Jinja's immutable
sandbox. The environment mirrors the one `transformers` gives templates (trim_blocks,
lstrip_blocks, `raise_exception`, a non-ASCII-escaping `tojson`, `strftime_now`) so that
a template renders here exactly as its authors tested it.
"""

from __future__ import annotations

import json
from datetime import datetime

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the conversation (its `raise_exception`) or failed to render."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled template plus the special-token strings templates refer to by name."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        self.source = source
        self._template = _environment().from_string(source)
        self._specials = dict(special_tokens)

    @property
    def knows_tools(self) -> bool:
        """Whether the template renders `tools` itself (those of Qwen2.5, Hermes, Llama 3.1
        do); for one that does not, the caller writes the tools into the messages."""
        return "tools" in self.source

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """`tools`: OpenAI's tool list, passed to the template as `transformers` passes it."""
        extra = {} if tools is None else {"tools": tools}
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._specials, **extra
            )
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, KeyError, IndexError) as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e

