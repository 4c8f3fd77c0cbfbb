"""The vocabulary of the OpenAI request protocol: which fields areal honours, the errors a bad
one gets, the body decode, and the readers of typed scalars. requests.py and sampling.py
build typed requests from them.
"""

from __future__ import annotations

from dataclasses import dataclass
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


def check_fields(d: dict[str, Any], allowed: frozenset[str] | set[str], what: str) -> None:
    for key, value in d.items():
        if value is None:
            continue  # null is "not given" in the OpenAI API: nothing asked, nothing ignored
        if key in _ONLY_DEFAULT:
            if value not in _ONLY_DEFAULT[key]:
                raise unsupported(key, f"is not supported by {what} (value {value!r})")
            continue
        if key not in allowed and key not in INFORMATIONAL:
            raise unsupported(key, f"is not a parameter {what} honours")


def load_body(body: bytes) -> dict[str, Any]:
    """The body as a JSON object (the one decode of a hop)."""
    if not body:
        raise bad("Request body is empty; expected a JSON object.", None, "invalid_json")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise bad(f"Request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise bad(
            f"Request body must be a JSON object, not {type(data).__name__}.",
            None,
            "invalid_body",
        )
    return data


@dataclass(frozen=True, slots=True)
class RequestHead:
    """What a hop that routes a request acts on: the model and whether it streams."""

    model: str
    stream: bool


def read_head(d: dict[str, Any], *, require_model: bool = True) -> RequestHead:
    """`model` (required where the request is routed by it) and `stream`. The proxy, given
    the model in the request's envelope, checks a model that is there the same way."""
    model = d.get("model")
    if model is None:
        if require_model:
            raise bad("Missing required parameter: 'model'.", "model", "missing_required_parameter")
        model = ""
    elif not isinstance(model, str) or not model:
        raise bad("'model' must be a non-empty string.", "model", "invalid_type")
    return RequestHead(model, stream_flag(d))


def stream_flag(d: dict[str, Any]) -> bool:
    v = d.get("stream")
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad("'stream' must be a boolean.", "stream", "invalid_type")
    return v


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_num(d: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = d.get(key)
    if v is None:
        return default
    if not is_num(v):
        raise bad(f"'{key}' must be a number", key)
    if not lo <= v <= hi:
        raise bad(f"'{key}' must be between {lo:g} and {hi:g}, got {v}", key)
    return float(v)


def read_int(d: dict[str, Any], key: str) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if not is_int(v):
        raise bad(f"'{key}' must be an integer", key)
    return int(v)


def read_bool(d: dict[str, Any], key: str, default: bool = False) -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be a boolean", key)
    return v


def read_int_list(v: Any, key: str) -> list[int]:
    if not isinstance(v, list) or not all(is_int(x) for x in v):
        raise bad(f"'{key}' must be a list of integers", key)
    return v


def stream_options(d: dict[str, Any]) -> bool:
    opts = d.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    return read_bool(opts, "include_usage") if "include_usage" in opts else False
