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
        # As the proxy reads a list of parts (areal_runtime.openai.requests): their texts,
        # one a line, so that a list and the string it stands for are one message.
        texts = []
        for p in content:
            if isinstance(p, dict):
                text = p.get("refusal" if p.get("type") == "refusal" else "text")
                if isinstance(text, str):
                    texts.append(text)
        return "\n".join(texts)
    return str(content)


def _has_float(value: Any) -> bool:
    """Whether parsed JSON holds a float (most arguments hold none: then nothing is copied)."""
    t = type(value)
    if t is dict:
        items: Any = value.values()
    elif t is list:
        items = value
    else:
        return t is float
    for v in items:
        t = type(v)
        if t is float or ((t is dict or t is list) and _has_float(v)):
            return True
    return False


def _integral(value: Any) -> Any:
    """`value` with every float that is a whole number written as an int: 1.0 and 1 are one
    JSON number, and JavaScript writes the first as the second."""
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _arguments(arguments: Any) -> list[Any]:
    """A tool call's arguments by meaning: parsed JSON (key order, whitespace, escapes and a
    number's spelling do not count), or the raw string where it is not JSON (tagged apart, so
    that the string `x` and the JSON string `"x"` differ). No arguments at all read as {}."""
    if arguments is None or arguments == "":
        return [1, {}]
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return [0, arguments]
    # (else an object a client sent unserialized)
    return [1, _integral(arguments) if _has_float(arguments) else arguments]


def canonical(message: dict[str, Any]) -> bytes:
    """The parts of a message that identify it across turns.

    Clients echo messages back with differences that change no meaning, and only the role,
    the text and the tool calls' names and arguments count:
    - content as a list of text parts or as the string they make, null or "";
    - tool calls' ids (a harness may mint its own), `type`, and their arguments' form (compact
      or spaced JSON, key order: compared parsed, `_arguments`);
    - reasoning and other fields beside the content (reasoning is split off the answer and
      not sent back by most clients);
    - whitespace around an assistant message's text (what the model wrote is its sampled
      ids, which the proxy keeps; a client that trims the text it shows changes nothing).
    """
    role = message.get("role", "")
    text = _text(message.get("content"))
    if role == "assistant":
        text = text.strip()
    listed = message.get("tool_calls")
    if not listed or not isinstance(listed, list):  # (the gateway hashes bodies unchecked)
        return orjson.dumps([role, text, []])
    fns = [
        fn if isinstance(fn := c.get("function"), dict) else {}
        for c in listed
        if isinstance(c, dict)
    ]
    calls = [[fn.get("name", ""), _arguments(fn.get("arguments"))] for fn in fns]
    try:
        return orjson.dumps([role, text, calls], option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:  # nested deeper than orjson writes: the arguments as sent
        raw = [[fn.get("name", ""), [0, str(fn.get("arguments"))]] for fn in fns]
        return orjson.dumps([role, text, raw])


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
