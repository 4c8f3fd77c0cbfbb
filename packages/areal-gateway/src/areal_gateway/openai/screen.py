"""Huge or intricate generation bodies parsed in a child process (areal_runtime.offload).

The gateway reads from a body only what it acts on (`model`, `stream`, the checks of
chat.py / completions.py, the prefix hashes of cache-aware routing) and forwards the bytes
as received. For a body of megabytes, or one whose structure is costly to build (a list of
a million empty objects parses ~25x slower than prose of its size: areal_runtime.bodycost),
that reading holds the GIL for tens to hundreds of milliseconds: every other request on the
gateway waits that long, per body. Such a body is parsed in the screen, a child process,
which answers what the gateway would have found (or the error it would have answered); the
gateway's own loop only moves the bytes. If the screen fails, the gateway parses the body
itself. A body with more structure than any request needs is refused here (413
`body_too_complex`), so that no hop parses it.

A Messages body (and count_tokens') is translated here too (anthropic/request.py): the
gateway gets the chat body it would have built, as bytes, and never parses either.

Frames: one kind byte, then the body. Answers:
- `CHAT`, `COMPLETION`: `{"model", "stream", "prefix"}`;
- `MESSAGES`, `COUNT_TOKENS`: that object with the translation's fields (`stop_sequences`,
  `left_out`, `context_management`, `system_at`), a newline, then the chat body;
- any kind: `{"status", "error": {...}}` (an OpenAI error body) for a body refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from areal_gateway.anthropic.request import Translated, translate
from areal_gateway.left_out import LeftOut
from areal_gateway.openai.chat import check_chat
from areal_gateway.openai.completions import check_completion
from areal_gateway.openai.forward import parse_model_and_stream, parse_object
from areal_gateway.prefix import prefix_hashes
from areal_runtime.bodycost import too_complex
from areal_runtime.errors import ServiceError

SCREEN_MIN_BODY = 256 * 1024
CHAT = b"c"
COMPLETION = b"p"
MESSAGES = b"m"
COUNT_TOKENS = b"t"


@dataclass(slots=True)
class Screened:
    """What the screen read from a body: the generation's fields, and for a Messages body
    the chat body it translates to (with the translation, less its `chat` dict)."""

    model: str
    stream: bool
    prefix: list[int]
    chat_body: bytes | None = None
    translated: Translated | None = None


def make() -> Callable[[bytes], bytes]:
    """The screen's function, for `Offload("areal_gateway.openai.screen:make", {})`."""

    def screen(frame: bytes) -> bytes:
        kind, body = frame[:1], frame[1:]
        try:
            refused = too_complex(body)
            if refused is not None:
                raise refused
            doc = parse_object(body)
            if kind in (MESSAGES, COUNT_TOKENS):
                return _translated(translate(doc, counting=kind == COUNT_TOKENS))
            model, stream = parse_model_and_stream(doc)
            (check_chat if kind == CHAT else check_completion)(doc)
        except ServiceError as err:
            return orjson.dumps({"status": err.http_status, **err.to_openai()})
        return orjson.dumps({"model": model, "stream": stream, "prefix": prefix_hashes(doc)})

    return screen


def _translated(t: Translated) -> bytes:
    head = {
        "model": t.model,
        "stream": t.stream,
        "prefix": prefix_hashes(t.chat),
        "stop_sequences": t.stop_sequences,
        "left_out": t.left_out.items,
        "context_management": t.context_management,
        "system_at": t.system_at,
    }
    return orjson.dumps(head) + b"\n" + orjson.dumps(t.chat)


def answer_of(raw: bytes) -> Screened:
    """What the screen found, or the error it found raised as the gateway would have."""
    head, _, chat = raw.partition(b"\n")
    answer: dict[str, Any] = orjson.loads(head)
    if "status" in answer:
        e = answer["error"]
        raise ServiceError(
            answer["status"], e["message"], type=e["type"], code=e["code"], param=e["param"]
        )
    found = Screened(answer["model"], answer["stream"], answer["prefix"])
    if "system_at" in answer:
        found.chat_body = chat
        found.translated = Translated(
            {},  # the chat body is `chat_body`, never parsed here
            found.model,
            found.stream,
            answer["stop_sequences"],
            LeftOut([tuple(i) for i in answer["left_out"]]),
            answer["context_management"],
            answer["system_at"],
        )
    return found
