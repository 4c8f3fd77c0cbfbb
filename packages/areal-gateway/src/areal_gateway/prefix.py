"""Hashes of growing prompt prefixes, for the router's cache_aware policy.

Requests that share a prompt prefix do best on the replica that already holds
that prefix in its KV cache. The gateway does not tokenize, so prefixes are cut
where the request itself has seams: after each chat message (hashed in the form the
proxy's lineage hashes it), or every
`TEXT_STEP` characters / `IDS_STEP` token ids of a completion prompt. Each hash
covers everything before its cut (chained), shortest first; the router keeps
the longest one it has seen served.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from areal_runtime.openai.messages import prefix_hashes as message_prefixes

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


def prefix_hashes(doc: dict[str, Any]) -> list[int]:
    messages = doc.get("messages")
    if isinstance(messages, list):
        # The proxy's lineage form of a message (areal_runtime.openai.messages).
        return _ints(message_prefixes([m for m in messages if isinstance(m, dict)], MAX_PREFIXES))
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
