"""Certified spans: each trained span of an exported row names the hash of the exact prompt
ids its tokens were sampled under, so a trainer can check that the row's prefix before the
span is that prompt (docs/services.md, "Certified spans").

The hash, defined here once (the proxy imports it): BLAKE2b with a 16-byte digest over the
ids packed as int32 little-endian, as lowercase hex (32 characters). An empty string is "not
recorded" (a turn recorded before prompt hashes existed): such a span is not certified.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

DIGEST_BYTES = 16


def pack_ids(ids: Iterable[int]) -> bytes:
    """Token ids as the hash reads them: int32, little-endian."""
    a = array("i", ids)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def prompt_hasher(ids: Iterable[int] = ()) -> Any:
    """A BLAKE2b-128 hasher fed `ids`; `.update(pack_ids(more))` extends it, `.copy()` forks
    it (a row's spans are checked in one pass over its ids)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(pack_ids(ids))
    return h


def prompt_hash(ids: Iterable[int]) -> str:
    """The hash of the prompt ids `ids`, as a span carries it."""
    return str(prompt_hasher(ids).hexdigest())


def uncertified_spans(
    input_ids: Sequence[int], spans: Iterable[tuple[int, int, str]]
) -> list[tuple[int, int, str]]:
    """The spans whose prefix `input_ids[:start]` does not hash to their prompt hash (or that
    carry none): empty when every span of the row was sampled under exactly its prefix."""
    h = prompt_hasher()
    at = 0
    bad = []
    for start, end, expected in sorted(spans):
        if start < at or end < start or end > len(input_ids):
            bad.append((start, end, expected))
            continue
        h.update(pack_ids(input_ids[at:start]))
        at = start
        if not expected or h.hexdigest() != expected:
            bad.append((start, end, expected))
    return bad
