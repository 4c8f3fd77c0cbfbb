"""Server-sent events framed exactly like OpenAI: `data: <json>\\n\\n` ... `data: [DONE]\\n\\n`."""

from __future__ import annotations

from areal_gateway.openai.errors import error_body
from areal_runtime.errors import ServiceError

DONE = b"data: [DONE]\n\n"

SSE_HEADERS: list[tuple[bytes, bytes]] = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def frame(data: bytes) -> bytes:
    """One event holding `data`, one OpenAI chunk as JSON. Compact JSON has no raw line break;
    should one occur (pretty-printed JSON), it is split over several `data:` lines, which an
    SSE client joins back with a newline (valid JSON whitespace)."""
    if b"\n" in data or b"\r" in data:
        lines = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        return b"".join(b"data: " + line + b"\n" for line in lines) + b"\n"
    return b"data: " + data + b"\n\n"


def error_frame(err: ServiceError) -> bytes:
    return frame(error_body(err))


def frames(batch: list[bytes]) -> bytes:
    """The events for chunks that arrived together, as one write."""
    if len(batch) == 1:
        return frame(batch[0])
    return b"".join(frame(data) for data in batch)
