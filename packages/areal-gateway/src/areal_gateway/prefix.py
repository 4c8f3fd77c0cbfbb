"""Hashes of growing prompt prefixes, for the router's cache_aware policy.

Requests that share a prompt prefix do best on the replica that already holds
that prefix in its KV cache. The gateway does not tokenize, so prefixes are cut
where the request itself has seams: after each chat message (hashed in the form the
proxy's lineage hashes it), or every
`TEXT_STEP` characters / `IDS_STEP` token ids of a completion prompt. Each hash
covers everything before its cut (chained), shortest first; the router keeps
the longest one it has seen served.

What is hashed is checked first, on every path and key kind that hashes: a field of the
wrong type (a role that is not a string, a text part whose text is `true`, a tool call's
name nested beyond what JSON writers accept) is a 400 naming that field, as the proxy
would answer, never a TypeError from the hashing. Only the hashed prefix is checked (at
most MAX_PREFIXES messages): the proxy checks the rest with the protocol's own parser.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from areal_runtime.openai.fields import bad
from areal_runtime.openai.messages import prefix_hashes as message_prefixes
from areal_runtime.openai.requests import check_tool_calls

MAX_PREFIXES = 32
TEXT_STEP = 256
IDS_STEP = 64


def _ints(hashes: list[bytes]) -> list[int]:
    return [int.from_bytes(h[:8], "little") for h in hashes]


def _chain(parts: list[bytes]) -> list[int]:
    out: list[int] = []
    acc = b""
    for part in parts[:MAX_PREFIXES]:
        acc = hashlib.blake2b(acc + part, digest_size=8).digest()
        out.append(int.from_bytes(acc, "little"))
    return out


_TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal"})


def _check_parts(parts: list[Any], param: str) -> None:
    for j, part in enumerate(parts):
        p = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise bad("a content part must be an object", p)
        kind = part.get("type")
        if not isinstance(kind, str):
            raise bad("a content part needs a string 'type'", f"{p}.type")
        if kind in _TEXT_PARTS:
            key = "refusal" if kind == "refusal" else "text"
            if not isinstance(part.get(key), str):
                raise bad(f"a {kind!r} content part needs a string", f"{p}.{key}")


def check_hashed(messages: list[Any]) -> None:
    """The fields `prefix_hashes` reads of the messages it hashes, with the protocol's words
    (areal_runtime.openai.requests), or InvalidRequest (400) naming the first bad one."""
    for i, m in enumerate(messages[:MAX_PREFIXES]):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad("a message must be an object", p)
        if not isinstance(m.get("role"), str):
            raise bad("a message needs a string 'role'", f"{p}.role")
        content = m.get("content")
        if isinstance(content, list):
            _check_parts(content, f"{p}.content")
        elif content is not None and not isinstance(content, str):
            raise bad("'content' must be a string or a list of content parts", f"{p}.content")
        if m.get("tool_calls") is not None:
            check_tool_calls(m["tool_calls"], f"{p}.tool_calls")


def prefix_hashes(doc: dict[str, Any]) -> list[int]:
    messages = doc.get("messages")
    if isinstance(messages, list):
        check_hashed(messages)
        # The proxy's lineage form of a message (areal_runtime.openai.messages).
        return _ints(message_prefixes(messages, MAX_PREFIXES))
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _chain(
            [prompt[i : i + TEXT_STEP].encode() for i in range(0, len(prompt), TEXT_STEP)]
        )
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return _chain(
            [orjson.dumps(prompt[i : i + IDS_STEP]) for i in range(0, len(prompt), IDS_STEP)]
        )
    return []
