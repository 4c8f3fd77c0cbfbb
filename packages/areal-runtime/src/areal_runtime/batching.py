"""Cutting a queue of frames into messages for the multiplexed `Generate` stream.

Both ends send whatever is queued as one message; a cap on its size keeps a message under
the receiver's limit and keeps one huge body from holding many small ones back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# About this many payload bytes per message at most (a single larger item still goes alone).
MAX_BATCH_BYTES = 4 << 20


def take_batch(
    queue: list[T], size: Callable[[T], int], limit: int = MAX_BATCH_BYTES
) -> tuple[list[T], list[T]]:
    """(the next message's items, what stays queued): at least one item, then as many as
    fit in `limit` bytes, in order."""
    total = 0
    for n, item in enumerate(queue):
        total += size(item)
        if total > limit and n > 0:
            return queue[:n], queue[n:]
    return queue, []
