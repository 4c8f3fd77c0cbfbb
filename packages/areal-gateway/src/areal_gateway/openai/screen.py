"""Huge chat and completion bodies parsed in a child process (areal_runtime.offload).

The gateway reads from a body only what it acts on (`model`, `stream`, the checks of
chat.py / completions.py, the prefix hashes of cache-aware routing) and forwards the bytes
as received. For a body of megabytes that reading is `orjson.loads` of all of it, tens of
milliseconds holding the GIL: every other request on the gateway waits that long, per body.
A body over `SCREEN_MIN_BODY` is parsed in the screen, a child process, which answers what
the gateway would have found (or the error it would have answered); the gateway's own loop
only moves the bytes. If the screen fails, the gateway parses the body itself.

Frames: one kind byte (`CHAT` or `COMPLETION`), then the body. Answer:
`{"model", "stream", "prefix"}` or `{"status", "error": {...}}` (an OpenAI error body).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from areal_gateway.openai.chat import check_chat
from areal_gateway.openai.completions import check_completion
from areal_gateway.openai.forward import parse_model_and_stream, parse_object
from areal_gateway.prefix import prefix_hashes
from areal_runtime.errors import ServiceError

SCREEN_MIN_BODY = 256 * 1024
CHAT = b"c"
COMPLETION = b"p"


def make() -> Callable[[bytes], bytes]:
    """The screen's function, for `Offload("areal_gateway.openai.screen:make", {})`."""

    def screen(frame: bytes) -> bytes:
        kind, body = frame[:1], frame[1:]
        try:
            doc = parse_object(body)
            model, stream = parse_model_and_stream(doc)
            (check_chat if kind == CHAT else check_completion)(doc)
        except ServiceError as err:
            return orjson.dumps({"status": err.http_status, **err.to_openai()})
        return orjson.dumps({"model": model, "stream": stream, "prefix": prefix_hashes(doc)})

    return screen


def answer_of(raw: bytes) -> tuple[str, bool, list[int]]:
    """What the screen found, or the error it found raised as the gateway would have."""
    answer: dict[str, Any] = orjson.loads(raw)
    if "status" in answer:
        e = answer["error"]
        raise ServiceError(
            answer["status"], e["message"], type=e["type"], code=e["code"], param=e["param"]
        )
    return answer["model"], answer["stream"], answer["prefix"]
