"""An engine's refusal of a request as invalid, told apart from the engine failing.

SGLang and vLLM answer a request they will not run with a 400 (SGLang, streamed: a first event
whose finish reason is an abort with `status_code` 400). That is the client's error, not the
engine's: it goes back as a 400 naming what to change, and an OpenAI SDK does not retry it.
The engine says what it refused only in words, so the words are matched here, once, against
what the engine versions areal installs say (measured on SGLang 0.5.23; read from vLLM 0.32's
source):

- prompt too long: SGLang "Input length (5021 tokens) exceeds the maximum allowed length
  (4090 tokens)...", "The input (9000 tokens) is longer than the model's context length (8192
  tokens)."; vLLM "The decoder prompt (length N) is longer than the maximum model length of
  M...", "This model's maximum context length is M tokens..."
- a grammar it cannot compile: SGLang "Failed to compile json grammar: [08:48:25]
  /project/cpp/json_schema_converter.cc:4175: Unsupported type "objekt""; vLLM "Invalid
  structural tag specification.", "Failed to transform json schema into a grammar: ...".
"""

from __future__ import annotations

import re

import orjson

from areal_proxy.engine.base import EngineError

PROMPT = "prompt"
CONSTRAINT = "constraint"
REQUEST = "request"

_CONSTRAINT_WORDS = ("grammar", "structural tag", "structural_tag", "json schema", "regex")
_PROMPT_WORDS = (
    "context length",
    "maximum allowed length",
    "maximum model length",
    "max_model_len",
    "input length",
    "input tokens",
)
# xgrammar prefixes its errors with a time and a C++ source location, which tell the client
# nothing: "[08:48:25] /project/cpp/json_schema_converter.cc:4175: ".
_SOURCE_LOCATION = re.compile(r"\[\d\d:\d\d:\d\d\]\s+\S+:\d+:\s*")
# The engine's advice to its own operator, not to the client.
_OPERATOR_ADVICE = (" Use a shorter input or enable --allow-auto-truncate.",)
_MAX_MESSAGE = 300


def clean(message: str) -> str:
    """The engine's message without source locations and operator advice, on one line."""
    text = _SOURCE_LOCATION.sub("", message)
    for advice in _OPERATOR_ADVICE:
        text = text.replace(advice, "")
    text = " ".join(text.split())
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


def kind_of(message: str) -> str:
    low = message.lower()
    if any(w in low for w in _CONSTRAINT_WORDS):
        return CONSTRAINT
    if any(w in low for w in _PROMPT_WORDS):
        return PROMPT
    return REQUEST


def refusal(message: str, status: int = 400) -> EngineError:
    """The engine's refusal of the request as an EngineError for the client (`refused` set;
    the message is the engine's own, cleaned: the proxy says what to change around it)."""
    text = clean(message)
    return EngineError(text, status=status, refused=kind_of(text))


def body_message(raw: bytes) -> str:
    """The message of an engine's error body: OpenAI's `{"error": {"message"}}`, FastAPI's
    `{"detail"}`, or the text itself."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode(errors="replace")
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):
        msg = err.get("message") or err.get("detail") or err
    else:
        msg = err
    return msg if isinstance(msg, str) else orjson.dumps(msg).decode()


def is_refusal_status(status: int) -> bool:
    """An HTTP status by which an engine refuses the request itself (not 404: a wrong URL)."""
    return status in (400, 413, 422)
