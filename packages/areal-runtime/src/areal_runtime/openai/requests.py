"""OpenAI request bodies -> typed requests, or InvalidRequest (400) naming the bad param.

The one parser of the protocol: the gateway (before anything is routed) and the proxy (the
hop that acts on every field) both turn a body into `ChatRequest` / `CompletionRequest` here,
so a bad body gets the same status, code, param and words whichever path, hop or key kind
it takes. Each hop parses a body once; the gateway forwards the bytes it parsed.

Nothing is accepted and silently ignored: a field outside CHAT_FIELDS / COMPLETION_FIELDS
(or one of INFORMATIONAL, which by the API's own definition changes no output) is a 400
`unsupported_parameter` naming it. docs/openai-api.md lists the same sets (tests/test_docs.py
compares them). The sampling extensions engines know (top_k, min_p, repetition_penalty,
ignore_eos, stop_token_ids, SGLang's regex / ebnf) are honoured.

Typed by hand-written checks into slotted dataclasses rather than msgspec or pydantic:
measured on the benchmark's chat body, the whole parse is 6.4 us (orjson's part 0.7 us) of
the ~2 ms a recorded request costs, and the checks name nested params
(`messages[3].content[0].type`) and keep unknown message keys for the chat template.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from areal_runtime.openai.fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    MAX_PROMPTS,
    MAX_TOP_LOGPROBS,
    ROLES,
    bad,
    check_fields,
    is_int,
    load_body,
    read_bool,
    read_head,
    read_int,
    stream_options,
    unsupported,
)
from areal_runtime.openai.sampling import Sampling, read_sampling

# Roles whose messages must carry content (assistant may carry only tool calls).
_CONTENT_REQUIRED = frozenset({"system", "developer", "user", "tool"})
_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal"})


@dataclass(slots=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    sampling: Sampling
    model: str = ""
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    include_usage: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


@dataclass(slots=True)
class CompletionRequest:
    sampling: Sampling
    model: str = ""
    stream: bool = False
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    # Every prompt of a list-of-prompts request (each a str or token ids); prompt_text /
    # prompt_ids hold the first.
    prompts: list[str | list[int]] = field(default_factory=list)
    echo: bool = False
    # None: no logprobs; otherwise how many top alternatives per token.
    logprobs: int | None = None
    include_usage: bool = False


def _text_of_parts(parts: list[Any], param: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        p = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise bad("a content part must be an object", p)
        kind = part.get("type")
        if not isinstance(kind, str):
            raise bad("a content part needs a string 'type'", f"{p}.type")
        if kind not in _TEXT_PART_TYPES:
            raise bad(
                f"content part type {kind!r} is not supported (this model takes text only)",
                f"{p}.type",
            )
        text = part.get(kind if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise bad(f"a {kind!r} content part needs a string", f"{p}.text")
        texts.append(text)
    return "\n".join(texts)


def check_tool_calls(calls: Any, param: str) -> None:
    """A message's `tool_calls` as the protocol shapes them, or InvalidRequest naming the
    first bad one (the gateway's prefix hashing checks with it too)."""
    if not isinstance(calls, list):
        raise bad("'tool_calls' must be a list", param)
    for k, call in enumerate(calls):
        p = f"{param}[{k}]"
        if not isinstance(call, dict):
            raise bad("a tool call must be an object", p)
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad("a tool call needs 'function' with a string 'name'", f"{p}.function")
        args = fn.get("arguments")
        if args is not None and not isinstance(args, (str, dict)):
            raise bad("'arguments' must be a JSON string", f"{p}.function.arguments")


def messages_of(d: dict[str, Any]) -> list[Any]:
    """`messages`, present and a non-empty array (its items are checked by `_messages`).
    All that the gateway checks of a chat body beside its head: what else a field may be
    depends on the model (an external one takes what its server takes)."""
    messages = d.get("messages")
    if messages is None:
        raise bad(
            "Missing required parameter: 'messages'.", "messages", "missing_required_parameter"
        )
    if not isinstance(messages, list):
        raise bad("'messages' must be an array.", "messages", "invalid_type")
    if not messages:
        raise bad("'messages' must contain at least one message.", "messages", "empty_array")
    return messages


def prompt_of(d: dict[str, Any]) -> Any:
    """`prompt`, present (its form is checked by `_prompts`)."""
    prompt = d.get("prompt")
    if prompt is None:
        raise bad("Missing required parameter: 'prompt'.", "prompt", "missing_required_parameter")
    return prompt


def _messages(d: dict[str, Any]) -> list[dict[str, Any]]:
    messages = messages_of(d)
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad("a message must be an object", p)
        role = m.get("role")
        if not isinstance(role, str):
            raise bad("a message needs a string 'role'", f"{p}.role")
        if role not in ROLES:
            raise bad(
                f"unknown role {role!r} (expected one of {', '.join(sorted(ROLES))})",
                f"{p}.role",
            )
        content = m.get("content")
        if isinstance(content, list):
            m["content"] = _text_of_parts(content, f"{p}.content")
        elif content is None:
            if role in _CONTENT_REQUIRED:
                raise bad(f"a {role} message needs 'content'", f"{p}.content")
        elif not isinstance(content, str):
            raise bad("'content' must be a string or a list of content parts", f"{p}.content")
        # Checked on every role, not only assistant: the recorder (recording/lineage.py) and
        # the chat template read `tool_calls` of any message, and a malformed one there (a
        # tool message with `"tool_calls": 5`) was a 500 for a session key, whose requests
        # are recorded, but a 400 for the admin key's unrecorded ones.
        if m.get("tool_calls") is not None:
            check_tool_calls(m["tool_calls"], f"{p}.tool_calls")
        elif role == "assistant" and content is None:
            raise bad("an assistant message needs 'content' or 'tool_calls'", f"{p}.content")
        if (name := m.get("name")) is not None and not isinstance(name, str):
            raise bad("'name' must be a string", f"{p}.name")
        if (tid := m.get("tool_call_id")) is not None and not isinstance(tid, str):
            raise bad("'tool_call_id' must be a string", f"{p}.tool_call_id")
    return messages


def _tools(d: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = d.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be a list", "tools")
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad("a tool must be an object", p)
        if t.get("type", "function") != "function":
            raise bad("only tools of type 'function' are supported", f"{p}.type")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise bad("a tool needs a 'function' object", f"{p}.function")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad("a tool function needs a non-empty string 'name'", f"{p}.function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad("'parameters' must be a JSON schema object", f"{p}.function.parameters")
    return tools or None


def _tool_choice(d: dict[str, Any]) -> Any:
    choice = d.get("tool_choice")
    if choice is None:
        return None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad(
                "'tool_choice' must be 'none', 'auto', 'required' or an object", "tool_choice"
            )
        return choice
    if isinstance(choice, dict):
        fn = choice.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad("'tool_choice' object needs 'function' with a 'name'", "tool_choice")
        return choice
    raise bad("'tool_choice' must be a string or an object", "tool_choice")


def parse_chat(body: bytes, *, require_model: bool = False) -> ChatRequest:
    d = load_body(body)
    head = read_head(d, require_model=require_model)
    check_fields(d, CHAT_FIELDS, "/v1/chat/completions")
    messages = _messages(d)
    sampling = read_sampling(d)
    logprobs = read_bool(d, "logprobs")
    top = read_int(d, "top_logprobs")
    if top is not None:
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs")
        if top and not logprobs:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    kwargs = d.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    return ChatRequest(
        messages=messages,
        model=head.model,
        stream=head.stream,
        sampling=sampling,
        tools=_tools(d),
        tool_choice=_tool_choice(d),
        parallel_tool_calls=read_bool(d, "parallel_tool_calls", True),
        logprobs=logprobs,
        top_logprobs=top or 0,
        include_usage=stream_options(d),
        template_kwargs=kwargs or {},
    )


def _one_prompt(prompt: Any, vocab_size: int, param: str) -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise bad("a prompt must not be empty", param)
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise bad("a prompt must not be empty", param)
        if not all(is_int(t) for t in prompt):
            raise bad("a prompt must be a string or a list of token ids", param)
        if vocab_size and any(t < 0 or t >= vocab_size for t in prompt):
            raise bad(
                f"the prompt has token ids outside the vocabulary (0..{vocab_size - 1})", param
            )
        return prompt
    raise bad("a prompt must be a string or a list of token ids", param)


def _prompts(d: dict[str, Any], vocab_size: int) -> list[str | list[int]]:
    """`prompt` as a list of prompts: a string, token ids, or a list of either."""
    prompt = prompt_of(d)
    if isinstance(prompt, list) and prompt and not is_int(prompt[0]):
        if len(prompt) > MAX_PROMPTS:
            raise bad(f"'prompt' takes at most {MAX_PROMPTS} prompts", "prompt")
        return [_one_prompt(p, vocab_size, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_one_prompt(prompt, vocab_size, "prompt")]


def parse_completion(
    body: bytes, *, vocab_size: int = 0, require_model: bool = False
) -> CompletionRequest:
    """`vocab_size` 0: token ids are not checked against a vocabulary (the gateway has none)."""
    d = load_body(body)
    head = read_head(d, require_model=require_model)
    check_fields(d, COMPLETION_FIELDS, "/v1/completions")
    if d.get("suffix") not in (None, ""):
        raise unsupported("suffix", "is not supported (no fill-in-the-middle)")
    prompts = _prompts(d, vocab_size)
    first = prompts[0]
    text, ids = (first, None) if isinstance(first, str) else (None, first)
    sampling = read_sampling(d)
    lp = d.get("logprobs")
    logprobs: int | None = None
    if lp is not None and lp is not False:
        if lp is True:
            lp = 0
        if not is_int(lp) or not 0 <= lp <= MAX_TOP_LOGPROBS:
            raise bad(f"'logprobs' must be an integer between 0 and {MAX_TOP_LOGPROBS}", "logprobs")
        logprobs = int(lp)
    return CompletionRequest(
        sampling=sampling,
        model=head.model,
        stream=head.stream,
        prompt_text=text,
        prompt_ids=ids,
        prompts=prompts,
        echo=read_bool(d, "echo"),
        logprobs=logprobs,
        include_usage=stream_options(d),
    )
