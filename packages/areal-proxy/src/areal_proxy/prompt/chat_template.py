"""The model's chat template, rendered in a sandboxed jinja2 environment (no transformers).

A request without a session is rendered whole and tokenized. A session's turn is built by
prompt/incremental.py: `concat` (the default) continues the exact ids of the turn it
extends, `hf` renders and tokenizes the conversation as a whole (continuing the previous
prompt's tokens only where that gives the same ids).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from areal_proxy.common.tokenizer import ModelTokenizer, PromptTooLong
from areal_proxy.prompt import tool_prompt

__all__ = ["ChatTemplate", "PromptBuilder", "PromptTooLong", "TemplateError", "ToolsNotRendered"]


class TemplateError(Exception):
    """The template refused the conversation (raise_exception) or failed to render."""


class ToolsNotRendered(Exception):
    """The template does not render `tools` and the tool-call parser has no default prompt
    (tool_prompt.py): the request's tools would be ignored."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's tojson: json.dumps defaults (", ", ": "), non-ASCII kept, no HTML escaping.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# Entries of the sandbox's verdict cache: (type, attribute) pairs a template looks up. A
# template names a handful; past this (names taken from data), verdicts are not kept.
_VERDICTS = 4096


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with its verdict on an attribute kept per (type, name).

    Whether an attribute is safe depends on the object's type and the name only (a private
    or internal name, or a method that mutates a known mutable type), but jinja2 works it out
    again for every access: `message.get(...)` once per message, a third of a long
    conversation's rendering. The verdicts are the sandbox's own, computed once."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._verdicts: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = super().is_safe_attribute(obj, attr, value)
            if len(self._verdicts) < _VERDICTS:
                self._verdicts[key] = verdict
        return verdict


class ChatTemplate:
    """One compiled template; render() is cheap and reads no file."""

    def __init__(
        self,
        source: str,
        *,
        bos_token: str | None,
        eos_token: str | None,
        tool_parser: str | None = "",
    ) -> None:
        """`tool_parser`: the tool-call parser in use ("" for none), or None to choose the
        one this template leaves no doubt about (tool_prompt.default_tool_parser)."""
        env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template does not compile: {e}") from e
        self._base = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        self.source = source
        self._renders_tools: bool | None = None
        # The parser whose format the default tool prompt asks for (tool_prompt.py).
        self.tool_parser = (
            tool_parser
            if tool_parser is not None
            else tool_prompt.default_tool_parser(source, self.renders_tools)
        )

    @property
    def renders_tools(self) -> bool:
        """Whether the template writes `tools` into the prompt (probed once)."""
        if self._renders_tools is None:
            self._renders_tools = tool_prompt.renders_tools(self._render)
        return self._renders_tools

    @property
    def writes_tool_prompt(self) -> bool:
        """Whether the proxy writes a request's `tools` into the prompt itself: the template
        ignores them and the tool-call parser's format has a default prompt."""
        return not self.renders_tools and tool_prompt.can_prompt(self.tool_parser)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> str:
        if tools and not self.renders_tools:
            if not tool_prompt.can_prompt(self.tool_parser):
                why = (
                    "no tool-call parser is set (start the proxy with --tool-call-parser hermes)"
                    if not self.tool_parser
                    else f"the {self.tool_parser!r} tool-call parser's format has no default "
                    "prompt (one of hermes, qwen25, llama3 has)"
                )
                raise ToolsNotRendered(
                    f"this model's chat template does not render 'tools' and {why}"
                )
            messages = tool_prompt.with_tools(messages, tools, self.tool_parser)
            tools = None
        return self._render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, extra=extra
        )

    def _render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> str:
        ctx: dict[str, Any] = {**(extra or {}), **self._base}
        ctx["messages"] = messages
        ctx["tools"] = tools
        ctx["add_generation_prompt"] = add_generation_prompt
        try:
            return self._template.render(ctx)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed: {e}") from e
        except TypeError as e:
            # A template written without tool calls in mind (SmolLM2's: `'...' +
            # message['content'] + ...`) fails on an assistant message that carries only
            # tool calls (content null, as every OpenAI client sends it): rendered with empty
            # content instead, the conversation goes on. Templates that handle null content
            # never get here; the messages recorded are the ones sent.
            if not any(m.get("content") is None for m in messages):
                raise TemplateError(f"chat template failed on this conversation: {e!r}") from e
            ctx["messages"] = [
                {**m, "content": ""} if m.get("content") is None else m for m in messages
            ]
            try:
                return self._template.render(ctx)
            except TemplateError:
                raise
            except (jinja2.TemplateError, TypeError, LookupError, AttributeError, ValueError) as e2:
                raise TemplateError(f"chat template failed on this conversation: {e2!r}") from e2
        except (KeyError, AttributeError, ValueError, IndexError) as e:
            raise TemplateError(f"chat template failed on this conversation: {e!r}") from e


class PromptBuilder:
    """Messages -> prompt token ids, in the configured template style."""

    def __init__(
        self, tok: ModelTokenizer, *, template_type: str = "concat", tool_parser: str | None = ""
    ) -> None:
        """`tool_parser`: as ChatTemplate takes it (None: chosen from the template)."""
        if template_type not in ("hf", "concat"):
            raise ValueError(f"unknown chat template type {template_type!r}")
        if not tok.chat_template:
            raise ValueError("the tokenizer folder has no chat template")
        self.template_type = template_type
        self._tok = tok
        self._template = ChatTemplate(
            tok.chat_template,
            bos_token=tok.bos_token,
            eos_token=tok.eos_token,
            tool_parser=tool_parser,
        )

    @property
    def template(self) -> ChatTemplate:
        return self._template

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        return self._template.render(messages, tools=tools, extra=extra)

    def prompt_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
        *,
        limit: int = 0,
        rendered: str | None = None,
    ) -> list[int]:
        """Token ids of the whole conversation rendered (a request without a session, in
        either template style: a session's turn is continued by prompt/incremental.py).

        `limit` (the context length; 0 = none): a rendered prompt whose length alone shows
        it has at least that many tokens raises PromptTooLong before it is tokenized
        (rendering is milliseconds for megabytes; tokenizing them, seconds). `rendered`: the
        whole conversation as `render_checked` already rendered it.
        """
        if rendered is None:
            rendered = self.render_checked(messages, tools, extra, limit)
        return self._tok.encode(rendered, limit=limit)

    def render_checked(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
        limit: int = 0,
    ) -> str:
        """The whole conversation rendered; PromptTooLong if its length alone shows it has
        at least `limit` tokens (0 = no limit)."""
        text = self.render(messages, tools, extra)
        if limit > 0 and (n := self._tok.min_tokens(text)) >= limit:
            raise PromptTooLong(n, exact=False)
        return text
