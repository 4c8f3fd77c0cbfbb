"""The prompt hash of a certified span: BLAKE2b with a 16-byte digest over the prompt ids
packed as int32 little-endian, as lowercase hex. Its definition for trainers is
areal_client.spans (a trainer recomputes it there); this copy keeps the inference proxy from
importing the client's HTTP stack, and tests/test_rl_row_schema.py holds the two equal.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable
from typing import Any

_LITTLE = sys.byteorder == "little"


def pack_ids(ids: Iterable[int]) -> bytes:
    a = array("i", ids)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def prompt_hasher(ids: Iterable[int] = ()) -> Any:
    """A hasher fed `ids` (`.update(pack_ids(more))` extends it, `.copy()` forks it)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(pack_ids(ids))
    return h


def prompt_hash(ids: Iterable[int]) -> str:
    return str(prompt_hasher(ids).hexdigest())
