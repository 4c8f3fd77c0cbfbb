"""OpenAI request bodies -> typed requests, or InvalidRequest (400) naming the bad param.

Nothing is accepted and silently ignored: a field outside CHAT_FIELDS / COMPLETION_FIELDS
(or one of INFORMATIONAL, which by the API's own definition changes no output) is a 400
`unsupported_parameter` naming it. docs/openai-api.md lists the same sets (tests/test_docs.py
compares them). The sampling extensions engines know (top_k, min_p, repetition_penalty,
ignore_eos, stop_token_ids, SGLang's regex / ebnf) are honoured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from areal_runtime.errors import InvalidRequest

MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
# Choices per request (`n`) and prompts per completions request: each one is a generation
# on the engine, and inside an RL session an interaction of its own.
MAX_N = 64
MAX_PROMPTS = 64
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# Roles whose messages must carry content (assistant may carry only tool calls).
_CONTENT_REQUIRED = frozenset({"system", "developer", "user", "tool"})
_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal"})


def bad(
    message: str, param: str | None = None, code: str | None = "invalid_request"
) -> InvalidRequest:
    return InvalidRequest(message, param=param, code=code)


def unsupported(param: str, why: str) -> InvalidRequest:
    return InvalidRequest(
        f"'{param}' {why}; docs/openai-api.md lists the parameters areal honours",
        param=param,
        code="unsupported_parameter",
    )


_SAMPLING_FIELDS = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "n",
        "max_tokens",
        "temperature",
        "top_p",
        "frequency_penalty",
        "presence_penalty",
        "seed",
        "stop",
        "logit_bias",
        "response_format",
        # Engine extensions (SGLang's and vLLM's names).
        "top_k",
        "min_p",
        "repetition_penalty",
        "ignore_eos",
        "skip_special_tokens",
        "stop_token_ids",
        "regex",
        "ebnf",
    }
)
CHAT_FIELDS = _SAMPLING_FIELDS | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
}
COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "logprobs", "echo", "best_of", "suffix"}
# Fields that by the API's definition change no output: accepted, and they change nothing.
INFORMATIONAL = frozenset(
    {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"}
)
# Fields accepted only at the value that asks for nothing areal lacks.
_ONLY_DEFAULT: dict[str, tuple[Any, ...]] = {
    "store": (None, False),  # a stored completion could be listed later: areal keeps none
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "functions": (None,),
    "function_call": (None,),
}


def _check_fields(d: dict[str, Any], allowed: frozenset[str] | set[str], what: str) -> None:
    for key, value in d.items():
        if value is None:
            continue  # null is "not given" in the OpenAI API: nothing asked, nothing ignored
        if key in _ONLY_DEFAULT:
            if value not in _ONLY_DEFAULT[key]:
                raise unsupported(key, f"is not supported by {what} (value {value!r})")
            continue
        if key not in allowed and key not in INFORMATIONAL:
            raise unsupported(key, f"is not a parameter {what} honours")


@dataclass(frozen=True, slots=True)
class Constraint:
    """Constrained decoding, engine-neutral: `kind` is json_schema, regex, ebnf or
    structural_tag (SGLang's sampling parameter names), `value` the engine's string."""

    kind: str
    value: str


@dataclass(slots=True)
class Sampling:
    """Sampling settings common to chat and completions."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = True
    n: int = 1
    constraint: Constraint | None = None
    # Engine sampling fields with no typed slot, forwarded as they came.
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    sampling: Sampling
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
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    # Every prompt of a list-of-prompts request (each a str or token ids); prompt_text /
    # prompt_ids hold the first.
    prompts: list[str | list[int]] = field(default_factory=list)
    echo: bool = False
    # None: no logprobs; otherwise how many top alternatives per token.
    logprobs: int | None = None
    include_usage: bool = False


def load_body(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise bad(f"request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise bad("request body must be a JSON object", None, "invalid_json")
    return data


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _num(d: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = d.get(key)
    if v is None:
        return default
    if not _is_num(v):
        raise bad(f"'{key}' must be a number", key)
    if not lo <= v <= hi:
        raise bad(f"'{key}' must be between {lo:g} and {hi:g}, got {v}", key)
    return float(v)


def _int(d: dict[str, Any], key: str) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if not _is_int(v):
        raise bad(f"'{key}' must be an integer", key)
    return int(v)


def _bool(d: dict[str, Any], key: str, default: bool = False) -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be a boolean", key)
    return v


def _int_list(v: Any, key: str) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(x) for x in v):
        raise bad(f"'{key}' must be a list of integers", key)
    return v


def _sampling(d: dict[str, Any]) -> Sampling:
    s = Sampling()
    if "model" in d and d["model"] is not None and not isinstance(d["model"], str):
        raise bad("'model' must be a string", "model")
    n = _int(d, "n")
    if n is not None:
        if not 1 <= n <= MAX_N:
            raise bad(f"'n' must be between 1 and {MAX_N}, got {n}", "n")
        s.n = n
    best_of = _int(d, "best_of")
    if best_of is not None and best_of != s.n:
        raise unsupported("best_of", "other than n is not supported (areal returns every sample)")
    for key in ("max_completion_tokens", "max_tokens"):
        v = _int(d, key)
        if v is not None:
            if v < 1:
                raise bad(f"'{key}' must be at least 1, got {v}", key)
            if s.max_tokens is None:
                s.max_tokens = v
    s.temperature = _num(d, "temperature", 1.0, 0.0, 2.0)
    s.top_p = _num(d, "top_p", 1.0, 0.0, 1.0)
    if s.top_p == 0.0:  # "top_p": 0 means greedy to most clients; engines refuse 0
        s.top_p, s.top_k = 1.0, 1
    s.frequency_penalty = _num(d, "frequency_penalty", 0.0, -2.0, 2.0)
    s.presence_penalty = _num(d, "presence_penalty", 0.0, -2.0, 2.0)
    s.min_p = _num(d, "min_p", 0.0, 0.0, 1.0)
    s.repetition_penalty = _num(d, "repetition_penalty", 1.0, 1e-6, 1e6)
    top_k = _int(d, "top_k")
    if top_k is not None and s.top_k == -1:
        if top_k < -1:
            raise bad("'top_k' must be -1 (off) or a positive integer", "top_k")
        s.top_k = top_k if top_k > 0 else -1
    s.seed = _int(d, "seed")
    s.ignore_eos = _bool(d, "ignore_eos")
    s.skip_special_tokens = _bool(d, "skip_special_tokens", True)
    stop = d.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise bad("'stop' must be a string or a list of strings", "stop")
        if len(stop) > MAX_STOP:
            raise bad(f"'stop' takes at most {MAX_STOP} sequences, got {len(stop)}", "stop")
        s.stop = [x for x in stop if x]
        if s.stop:
            s.extra["stop"] = s.stop
    if (ids := d.get("stop_token_ids")) is not None:
        s.stop_token_ids = _int_list(ids, "stop_token_ids")
    if (bias := d.get("logit_bias")) is not None:
        if not isinstance(bias, dict) or not all(_is_num(v) for v in bias.values()):
            raise bad("'logit_bias' must map token ids to numbers", "logit_bias")
        if bias:
            s.extra["logit_bias"] = {str(k): float(v) for k, v in bias.items()}
    s.constraint = _constraint(d)
    return s


def _constraint(d: dict[str, Any]) -> Constraint | None:
    """The output constraint of `response_format`, or of SGLang's `regex` / `ebnf`."""
    found: list[Constraint] = []
    for key in ("regex", "ebnf"):
        v = d.get(key)
        if v is None:
            continue
        if not isinstance(v, str) or not v:
            raise bad(f"'{key}' must be a non-empty string", key)
        found.append(Constraint(key, v))
    rf = d.get("response_format")
    if rf is not None:
        c = response_format_constraint(rf, "response_format")
        if c is not None:
            found.append(c)
    if len(found) > 1:
        raise bad(
            "only one of 'response_format', 'regex' and 'ebnf' may constrain the output",
            "response_format",
        )
    return found[0] if found else None


def response_format_constraint(rf: Any, param: str) -> Constraint | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad(f"'{param}' must be an object with a string 'type'", param)
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_schema", '{"type": "object"}')
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad(f"'{param}.json_schema' must be an object", f"{param}.json_schema")
        schema = js.get("schema", {})
        if not isinstance(schema, dict):
            raise bad("'schema' must be a JSON schema object", f"{param}.json_schema.schema")
        if (strict := js.get("strict")) is not None and not isinstance(strict, bool):
            raise bad("'strict' must be a boolean", f"{param}.json_schema.strict")
        # strict or not, the output is held to the schema: the engine enforces it.
        return Constraint("json_schema", orjson.dumps(schema or {"type": "object"}).decode())
    if kind == "regex":  # SGLang's extension of response_format
        pattern = rf.get("regex") or rf.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise bad("a 'regex' response format needs a string 'regex'", f"{param}.regex")
        return Constraint("regex", pattern)
    raise bad(
        f"response format type {kind!r} is not supported "
        "(expected text, json_object, json_schema or regex)",
        f"{param}.type",
        "unsupported_parameter",
    )


def _stream_options(d: dict[str, Any]) -> bool:
    opts = d.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    return _bool(opts, "include_usage") if "include_usage" in opts else False


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


def _tool_calls(calls: Any, param: str) -> None:
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


def _messages(d: dict[str, Any]) -> list[dict[str, Any]]:
    messages = d.get("messages")
    if messages is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(messages, list):
        raise bad("'messages' must be a list", "messages")
    if not messages:
        raise bad("'messages' must not be empty", "messages")
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
            _tool_calls(m["tool_calls"], f"{p}.tool_calls")
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


def parse_chat(body: bytes) -> ChatRequest:
    d = load_body(body)
    _check_fields(d, CHAT_FIELDS, "/v1/chat/completions")
    messages = _messages(d)
    sampling = _sampling(d)
    logprobs = _bool(d, "logprobs")
    top = _int(d, "top_logprobs")
    if top is not None:
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs")
        if top and not logprobs:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    kwargs = d.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    if d.get("stream") is not None and not isinstance(d["stream"], bool):
        raise bad("'stream' must be a boolean", "stream")
    return ChatRequest(
        messages=messages,
        sampling=sampling,
        tools=_tools(d),
        tool_choice=_tool_choice(d),
        parallel_tool_calls=_bool(d, "parallel_tool_calls", True),
        logprobs=logprobs,
        top_logprobs=top or 0,
        include_usage=_stream_options(d),
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
        if not all(_is_int(t) for t in prompt):
            raise bad("a prompt must be a string or a list of token ids", param)
        if vocab_size and any(t < 0 or t >= vocab_size for t in prompt):
            raise bad(
                f"the prompt has token ids outside the vocabulary (0..{vocab_size - 1})", param
            )
        return prompt
    raise bad("a prompt must be a string or a list of token ids", param)


def _prompts(d: dict[str, Any], vocab_size: int) -> list[str | list[int]]:
    """`prompt` as a list of prompts: a string, token ids, or a list of either."""
    prompt = d.get("prompt")
    if prompt is None:
        raise bad("'prompt' is required", "prompt")
    if isinstance(prompt, list) and prompt and not _is_int(prompt[0]):
        if len(prompt) > MAX_PROMPTS:
            raise bad(f"'prompt' takes at most {MAX_PROMPTS} prompts", "prompt")
        return [_one_prompt(p, vocab_size, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_one_prompt(prompt, vocab_size, "prompt")]


def parse_completion(body: bytes, *, vocab_size: int = 0) -> CompletionRequest:
    d = load_body(body)
    _check_fields(d, COMPLETION_FIELDS, "/v1/completions")
    if d.get("suffix") not in (None, ""):
        raise unsupported("suffix", "is not supported (no fill-in-the-middle)")
    prompts = _prompts(d, vocab_size)
    first = prompts[0]
    text, ids = (first, None) if isinstance(first, str) else (None, first)
    sampling = _sampling(d)
    lp = d.get("logprobs")
    logprobs: int | None = None
    if lp is not None and lp is not False:
        if lp is True:
            lp = 0
        if not _is_int(lp) or not 0 <= lp <= MAX_TOP_LOGPROBS:
            raise bad(f"'logprobs' must be an integer between 0 and {MAX_TOP_LOGPROBS}", "logprobs")
        logprobs = int(lp)
    if d.get("stream") is not None and not isinstance(d["stream"], bool):
        raise bad("'stream' must be a boolean", "stream")
    return CompletionRequest(
        sampling=sampling,
        prompt_text=text,
        prompt_ids=ids,
        prompts=prompts,
        echo=_bool(d, "echo"),
        logprobs=logprobs,
        include_usage=_stream_options(d),
    )
