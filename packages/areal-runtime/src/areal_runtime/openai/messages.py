"""The one canonical form of a chat message, and chained hashes of a conversation's prefixes.

The proxy's lineage finds a turn's parent by them (recording/lineage.py), and the gateway's
cache-aware routing places a prompt by them (areal_gateway/prefix.py): one form, so that a
message means the same to both hops.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def canonical(message: dict[str, Any]) -> bytes:
    """The parts of a message that identify it across turns.

    Clients echo assistant messages back with small differences (call ids,
    missing reasoning, content parts instead of a string); only the role,
    the text and the tool calls' names and arguments count.
    """
    calls = [
        (c.get("function", {}).get("name", ""), c.get("function", {}).get("arguments", ""))
        for c in message.get("tool_calls") or []
        if isinstance(c, dict)
    ]
    return orjson.dumps([message.get("role", ""), _text(message.get("content")), calls])


def chained(h: bytes, message: dict[str, Any]) -> bytes:
    """The hash of a conversation whose hash is `h`, followed by `message`."""
    return hashlib.blake2b(h + canonical(message), digest_size=16).digest()


def prefix_hashes(messages: list[dict[str, Any]], limit: int | None = None) -> list[bytes]:
    """h[k] identifies messages[: k + 1] (the first `limit` prefixes, or all)."""
    out: list[bytes] = []
    h = b""
    for m in messages if limit is None else messages[:limit]:
        h = chained(h, m)
        out.append(h)
    return out
