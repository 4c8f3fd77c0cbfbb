"""Server-sent events framed exactly like OpenAI: `data: <json>\\n\\n` ... `data: [DONE]\\n\\n`
(the encoding is `areal_runtime.sse`, shared with every service)."""

from __future__ import annotations

from areal_gateway.openai.errors import error_body
from areal_runtime.errors import ServiceError
from areal_runtime.sse import DONE, encode, encode_all

__all__ = ["DONE", "SSE_HEADERS", "error_frame", "frame", "frames"]

SSE_HEADERS: list[tuple[bytes, bytes]] = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]

# One event holding one OpenAI chunk as JSON; the events for chunks that arrived together.
frame = encode
frames = encode_all


def error_frame(err: ServiceError) -> bytes:
    return frame(error_body(err))
